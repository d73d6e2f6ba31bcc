// Fused paged attention, one workgroup per (query row, query head, KV partition): online softmax
// over tiles of WG keys read straight from the quantized pages. Long contexts with few query rows
// are split into partitions (flash-decoding); combine.wgsl merges the partial results.
const D: u32 = ${D}u;
const H: u32 = ${H}u;      // KV heads
const BS: u32 = ${BS}u;
const KPPC: u32 = ${KPPC}u;
const VPPC: u32 = ${VPPC}u;
const KRB: u32 = ${KRB}u;
const VRB: u32 = ${VRB}u;
const WG: u32 = ${WG}u;
const DPL: u32 = (D + WG - 1u) / WG;  // output dims per lane

struct Params { nx: u32, rows: u32, hq: u32, group: u32, parts: u32, maxb: u32, table_off: u32, scale: f32 }
@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;      // [rows, hq, D]
@group(0) @binding(2) var<storage, read> tab: array<u32>;   // [rows] x (seq, lo, hi, 0), then the block table
@group(0) @binding(3) var<storage, read_write> part: array<f32>;  // [rows, hq, parts] x (acc[D], m, l)

var<workgroup> qv: array<f32, D>;
var<workgroup> sc: array<f32, WG>;
var<workgroup> pw: array<f32, WG>;
var<workgroup> vc: array<u32, WG>;
var<workgroup> vr: array<u32, WG>;
var<workgroup> wg_a: u32;
var<workgroup> wg_b: u32;
var<workgroup> wg_t: u32;

${FORMAT}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let id = wid.x + wid.y * prm.nx;
    if (id >= prm.rows * prm.hq * prm.parts) {
        return;
    }
    let p = id % prm.parts;
    let rh = id / prm.parts;  // row * hq + head
    let row = rh / prm.hq;
    let kvh = (rh % prm.hq) / prm.group;
    for (var d = lane; d < D; d += WG) {
        qv[d] = q[rh * D + d];
    }
    if (lane == 0u) {
        let lo = tab[row * 4u + 1u];
        let hi = tab[row * 4u + 2u];
        let chunk = (hi - lo + prm.parts - 1u) / prm.parts;
        let a = min(hi, lo + p * chunk);
        wg_a = a;
        wg_b = min(hi, a + chunk);
        wg_t = prm.table_off + tab[row * 4u] * prm.maxb;
    }
    let a = workgroupUniformLoad(&wg_a);
    let b = workgroupUniformLoad(&wg_b);
    let tb = wg_t;
    var m = NEG;
    var l = 0.0;
    var acc: array<f32, DPL>;
    for (var t0 = a; t0 < b; t0 += WG) {
        let t = t0 + lane;
        var s = NEG;
        if (t < b) {
            let page = tab[tb + t / BS];
            let off = t % BS;
            s = k_dot(page / KPPC, (((page % KPPC) * H + kvh) * BS + off) * KRB) * prm.scale;
            vc[lane] = page / VPPC;
            vr[lane] = (((page % VPPC) * H + kvh) * BS + off) * VRB;
        }
        sc[lane] = s;
        workgroupBarrier();
        let nt = min(WG, b - t0);
        var mt = m;
        for (var j = 0u; j < nt; j++) {
            mt = max(mt, sc[j]);
        }
        pw[lane] = exp(sc[lane] - mt);
        workgroupBarrier();
        let corr = exp(m - mt);
        l = l * corr;
        for (var r = 0u; r < DPL; r++) {
            acc[r] = acc[r] * corr;
        }
        for (var j = 0u; j < nt; j++) {
            let pj = pw[j];
            l = l + pj;
            for (var r = 0u; r < DPL; r++) {
                let d = lane + r * WG;
                if (d < D) {
                    acc[r] += pj * v_deq(vc[j], vr[j], d);
                }
            }
        }
        m = mt;
        workgroupBarrier();
    }
    let base = id * (D + 2u);
    for (var r = 0u; r < DPL; r++) {
        let d = lane + r * WG;
        if (d < D) {
            part[base + d] = acc[r];
        }
    }
    if (lane == 0u) {
        part[base + D] = m;
        part[base + D + 1u] = l;
    }
}
