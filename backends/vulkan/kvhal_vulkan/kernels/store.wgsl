// store: quantize 32 values (one ggml block, or 32 values of a float row) per workgroup and write
// them into the token's slot. Units in memory order alternate between two dispatches (parity): a
// unit is not word-aligned, so two adjacent units share a u32; same-parity units never do, and
// each unit's boundary words are read-modify-written by one invocation only.
const D: u32 = ${D}u;
const H: u32 = ${H}u;
const BS: u32 = ${BS}u;
const PPC: u32 = ${PPC}u;  // pages per pool chunk (one storage binding)
const RB: u32 = ${RB}u;    // row bytes
const UPR: u32 = ${UPR}u;  // units per row
const UB: u32 = ${UB}u;    // bytes of a full unit
const VB: u32 = ${VB}u;    // bytes per value (float formats), 0 for block formats

struct Params { nx: u32, n: u32, src_off: u32, slot_off: u32, parity: u32 }
@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;  // f32 bits [n, H, D]
@group(0) @binding(2) var<storage, read> tab: array<u32>;

var<workgroup> xb: array<u32, 32>;  // input bits
var<workgroup> ps: array<f32, 32>;  // products x * id
var<workgroup> qs: array<u32, 32>;  // quants
var<workgroup> st: array<u32, 4>;   // d, id, min (f32 bits)
var<workgroup> hw: array<u32, 64>;  // the unit's bytes as 16-bit halves
var<workgroup> wg_go: u32;
var<workgroup> wg_c: u32;
var<workgroup> wg_s: u32;

// q4_0/q5_0: d = (signed value of largest magnitude, first occurrence) / div; q = min(trunc(x*id + off), qmax)
fn quant_absmax(lane: u32, div: u32, off: f32, qmax: u32) {
    if (lane == 0u) {
        var best = xb[0] & 0x7fffffffu;
        var idx = 0u;
        for (var j = 1u; j < 32u; j++) {
            let a = xb[j] & 0x7fffffffu;
            if (a > best) {
                best = a;
                idx = j;
            }
        }
        // ggml starts from max = 0.0f: an all-zero block keeps +0.0 even when its values are -0.0
        let d = div_rn(select(xb[idx], 0u, best == 0u), div);
        st[0] = d;
        st[1] = inv_bits(d);
    }
    workgroupBarrier();
    ps[lane] = bitcast<f32>(xb[lane]) * bitcast<f32>(st[1]);
    workgroupBarrier();
    let j = lane ^ 1u;  // another invocation's product: no mul+add fusion possible
    qs[j] = min(u32(trunc(ps[j] + off)), qmax);
    workgroupBarrier();
}

// q4_1/q5_1: d = (max - min) / div; q = min(trunc((x - min)*id + 0.5), qmax)
fn quant_minmax(lane: u32, div: u32, qmax: u32) {
    if (lane == 0u) {
        var lo = bitcast<f32>(xb[0]);
        var hi = lo;
        for (var j = 1u; j < 32u; j++) {
            let x = bitcast<f32>(xb[j]);
            if (x < lo) {
                lo = x;
            }
            if (x > hi) {
                hi = x;
            }
        }
        let d = div_rn(bitcast<u32>(hi - lo), div);
        st[0] = d;
        st[1] = inv_bits(d);
        st[2] = bitcast<u32>(lo);
    }
    workgroupBarrier();
    ps[lane] = (bitcast<f32>(xb[lane]) - bitcast<f32>(st[2])) * bitcast<f32>(st[1]);
    workgroupBarrier();
    let j = lane ^ 1u;
    qs[j] = min(u32(trunc(ps[j] + 0.5)), qmax);
    workgroupBarrier();
}

// bytes 2l and 2l+1 of the nibble array: value k low, value k+16 high in byte k
fn nibble_half(l: u32) -> u32 {
    let a = (qs[2u * l] & 15u) | ((qs[2u * l + 16u] & 15u) << 4u);
    let b = (qs[2u * l + 1u] & 15u) | ((qs[2u * l + 17u] & 15u) << 4u);
    return a | (b << 8u);
}

fn high_bits() -> u32 {
    var qh = 0u;
    for (var j = 0u; j < 32u; j++) {
        qh = qh | (((qs[j] >> 4u) & 1u) << j);
    }
    return qh;
}

${FORMAT}

@compute @workgroup_size(32)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let uid = wid.x + wid.y * prm.nx;
    if (uid >= prm.n * H * UPR) {
        return;
    }
    let u = uid % UPR;
    let h = (uid / UPR) % H;
    let i = uid / (UPR * H);
    if (lane == 0u) {
        let slot = tab[prm.slot_off + i];
        let blk = slot / BS;
        let r = ((blk % PPC) * H + h) * BS + slot % BS;  // row index inside the chunk
        wg_go = select(0u, 1u, ((r * UPR + u) & 1u) == prm.parity);
        wg_c = blk / PPC;
        wg_s = r * RB + u * UB;
    }
    if (workgroupUniformLoad(&wg_go) == 0u) {
        return;
    }
    let nv = min(32u, D - u * 32u);
    if (lane < nv) {
        xb[lane] = src[prm.src_off + (i * H + h) * D + u * 32u + lane];
    } else {
        xb[lane] = 0u;
    }
    workgroupBarrier();
    quant(lane, nv);
    workgroupBarrier();
    var nh = UB / 2u;
    if (VB != 0u) {
        nh = nv * VB / 2u;
    }
    let c = wg_c;
    let s = wg_s;  // even: every row and unit is a whole number of 16-bit halves
    let off = (s >> 1u) & 1u;
    let w0 = s >> 2u;
    let nw = (off + nh + 1u) / 2u;
    for (var w = lane; w < nw; w += 32u) {
        var val = 0u;
        var mask = 0u;
        for (var k = 0u; k < 2u; k++) {
            let j = i32(2u * w + k) - i32(off);
            if (j >= 0 && j < i32(nh)) {
                val = val | (hw[j] << (16u * k));
                mask = mask | (0xffffu << (16u * k));
            }
        }
        if (mask != 0xffffffffu) {
            val = val | (p_rd(c, w0 + w) & ~mask);
        }
        p_wr(c, w0 + w, val);
    }
}
