// store: one invocation quantizes QK values (one ggml block, or QK values of a float row) and writes
// them into the token's slot. Units are not word-aligned, so the words a unit shares with its
// neighbours are updated with atomicAnd/atomicOr on its own bytes only.
const D: u32 = ${D}u;
const H: u32 = ${H}u;
const BS: u32 = ${BS}u;
const PPC: u32 = ${PPC}u;  // pages per pool chunk (one storage binding)
const RB: u32 = ${RB}u;    // row bytes
const UPR: u32 = ${UPR}u;  // units per row
const UB: u32 = ${UB}u;    // bytes of a full unit
const VB: u32 = ${VB}u;    // bytes per value (float formats), 0 for block formats

struct Params { nx: u32, n: u32, src_off: u32, slot_off: u32 }
@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;  // f32 bits [n, H, D]
@group(0) @binding(2) var<storage, read> tab: array<u32>;

// Each invocation assembles its unit in workgroup memory, shifted to the unit's offset inside the
// pool's words (private arrays with dynamic indices compile slowly and spill on some drivers)
const OWS: u32 = (UB + 5u) / 4u;
var<workgroup> ow: array<u32, WG * OWS>;
var<private> ob: u32;     // this invocation's first byte in ow
var<private> xbase: u32;  // its first input value in src
var<private> xn: u32;     // values in this unit

const C8_5: u32 = 0x11000000u;   // 8.5 * 2^25, for floor_add
const C16_5: u32 = 0x21000000u;  // 16.5 * 2^25
const C0_5: u32 = 0x01000000u;   // 0.5 * 2^25

fn x(j: u32) -> u32 {
    return select(0u, src[xbase + min(j, xn - 1u)], j < xn);
}

fn put_half(k: u32, h: u32) {
    let b = ob + 2u * k;
    ow[b >> 2u] |= h << ((b & 2u) * 8u);
}

fn put_byte(k: u32, v: u32) {
    let b = ob + k;
    ow[b >> 2u] |= v << ((b & 3u) * 8u);
}

// ggml's q4_0/q5_0 scale source: the value of largest magnitude, first occurrence, with its sign;
// ggml starts from max = 0.0f, so an all-zero block gives +0.0 even when its values are -0.0
fn signed_absmax() -> u32 {
    var best = 0u;
    var mx = 0u;
    for (var j = 0u; j < QK; j++) {
        let a = x(j) & 0x7fffffffu;  // |x| compared as bits: monotonic, immune to denormal flushing
        if (a > best) {
            best = a;
            mx = x(j);
        }
    }
    return mx;
}

// trunc(x*id + c) of q4_0/q5_0, clamped to qmax
fn q_sym(xv: u32, id: f32, c: u32, qmax: u32) -> u32 {
    return min(floor_add(bitcast<u32>(bitcast<f32>(xv) * id), c, true), qmax);
}

// trunc((x - min)*id + 0.5) of q4_1/q5_1, clamped to qmax
fn q_min(xv: u32, lo: f32, id: f32, qmax: u32) -> u32 {
    return min(floor_add(bitcast<u32>((bitcast<f32>(xv) - lo) * id), C0_5, true), qmax);
}

// ggml's scan for q4_1/q5_1: if (v < min) min = v; if (v > max) max = v (first of equal values wins)
fn min_max() -> vec2<f32> {
    var lo = bitcast<f32>(x(0u));
    var hi = lo;
    for (var j = 1u; j < QK; j++) {
        let v = bitcast<f32>(x(j));
        if (v < lo) {
            lo = v;
        }
        if (v > hi) {
            hi = v;
        }
    }
    return vec2<f32>(lo, hi);
}

${FORMAT}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let uid = (wid.x + wid.y * prm.nx) * WG + lane;
    if (uid >= prm.n * H * UPR) {
        return;
    }
    let u = uid % UPR;
    let h = (uid / UPR) % H;
    let i = uid / (UPR * H);
    let slot = tab[prm.slot_off + i];
    let blk = slot / BS;
    let c = blk / PPC;
    let s = ((((blk % PPC) * H + h) * BS + slot % BS) * RB) + u * UB;  // even: rows are whole halves
    let nv = min(QK, D - u * QK);
    xbase = prm.src_off + (i * H + h) * D + u * QK;
    xn = nv;
    let off = (s >> 1u) & 1u;  // the unit starts in the upper half of a pool word
    let own = lane * OWS;
    for (var w = 0u; w < OWS; w++) {
        ow[own + w] = 0u;
    }
    ob = own * 4u + off * 2u;
    quant(nv);
    var nb = UB;
    if (VB != 0u) {
        nb = nv * VB;
    }
    let w0 = s >> 2u;
    let end = off * 2u + nb;  // byte after the unit, counted from the first word
    for (var w = 0u; w * 4u < end; w++) {
        let lo = max(w * 4u, off * 2u) - w * 4u;
        let hi = min(w * 4u + 4u, end) - w * 4u;
        let val = ow[own + w];
        if (lo == 0u && hi == 4u) {
            p_st(c, w0 + w, val);
        } else {  // a word shared with a neighbouring unit that another invocation may be writing
            let mask = (0xffffffffu >> (32u - 8u * (hi - lo))) << (8u * lo);
            p_and(c, w0 + w, ~mask);
            p_or(c, w0 + w, val);
        }
    }
}
