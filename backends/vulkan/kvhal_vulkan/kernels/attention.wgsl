// Fused paged attention. One workgroup per (query row, KV head, tile of HT query heads of that KV
// head's group, KV partition): each K/V row is dequantized once for the HT heads that read it, with
// an online softmax over tiles of WG keys. Long contexts with few query rows are split into
// partitions (flash-decoding); combine.wgsl merges the partial results.
const D: u32 = ${D}u;
const H: u32 = ${H}u;      // KV heads
const BS: u32 = ${BS}u;
const KPPC: u32 = ${KPPC}u;
const VPPC: u32 = ${VPPC}u;
const KRB: u32 = ${KRB}u;
const VRB: u32 = ${VRB}u;
const HT: u32 = ${HT}u;
const NB: u32 = (D + QK - 1u) / QK;  // quantized blocks per row
const DPL: u32 = (D + WG - 1u) / WG;  // output dims per lane

struct Params { nx: u32, rows: u32, hq: u32, group: u32, parts: u32, maxb: u32, table_off: u32, scale: f32 }
@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;      // [rows, hq, D]
@group(0) @binding(2) var<storage, read> tab: array<u32>;    // [rows] x (seq, lo, hi, 0), then the block table
@group(0) @binding(3) var<storage, read_write> part: array<f32>;  // [rows, hq, parts] x (acc[D], m, l)

var<workgroup> qv: array<f32, HT * D>;
var<workgroup> qbs: array<f32, HT * NB>;  // per-block sums of q (the min term of q4_1/q5_1)
var<workgroup> sc: array<f32, HT * WG>;
var<workgroup> pw: array<f32, HT * WG>;
var<workgroup> ms: array<f32, HT>;  // running max per head
var<workgroup> ls: array<f32, HT>;  // running sum per head
var<workgroup> cs: array<f32, HT>;  // this tile's rescale factor per head
var<workgroup> vc: array<u32, WG>;
var<workgroup> vr: array<u32, WG>;
var<workgroup> wg_a: u32;
var<workgroup> wg_b: u32;
var<workgroup> wg_t: u32;

${FORMAT}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let id = wid.x + wid.y * prm.nx;
    let nt = prm.group / HT;
    if (id >= prm.rows * H * nt * prm.parts) {
        return;
    }
    let p = id % prm.parts;
    let rt = id / prm.parts;
    let kvh = (rt / nt) % H;
    let row = rt / (nt * H);
    let h0 = kvh * prm.group + (rt % nt) * HT;  // first query head of this tile
    for (var e = lane; e < HT * D; e += WG) {
        qv[e] = q[(row * prm.hq + h0) * D + e];
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
    let a = workgroupUniformLoad(&wg_a);  // also a barrier: qv is complete
    let b = workgroupUniformLoad(&wg_b);
    let tb = wg_t;
    for (var e = lane; e < HT * NB; e += WG) {
        let g = e / NB;
        let blk = e % NB;
        var sum = 0.0;
        for (var j = blk * QK; j < min(D, blk * QK + QK); j++) {
            sum += qv[g * D + j];
        }
        qbs[e] = sum;
    }
    workgroupBarrier();
    // running max and sum of each head live in workgroup memory, updated by lane g for head g
    if (lane < HT) {
        ms[lane] = NEG;
        ls[lane] = 0.0;
    }
    var acc = array<f32, HT * DPL>();
    for (var t0 = a; t0 < b; t0 += WG) {
        let t = t0 + lane;
        if (t < b) {
            let page = tab[tb + t / BS];
            let off = t % BS;
            let s = k_dot(page / KPPC, (((page % KPPC) * H + kvh) * BS + off) * KRB);
            for (var g = 0u; g < HT; g++) {
                sc[g * WG + lane] = s[g] * prm.scale;
            }
            vc[lane] = page / VPPC;
            vr[lane] = (((page % VPPC) * H + kvh) * BS + off) * VRB;
        } else {
            for (var g = 0u; g < HT; g++) {
                sc[g * WG + lane] = NEG;
            }
        }
        workgroupBarrier();
        let n = min(WG, b - t0);
        if (lane < HT) {
            var mt = ms[lane];
            for (var j = 0u; j < n; j++) {
                mt = max(mt, sc[lane * WG + j]);
            }
            cs[lane] = exp(ms[lane] - mt);
            ms[lane] = mt;
        }
        workgroupBarrier();
        for (var g = 0u; g < HT; g++) {
            pw[g * WG + lane] = exp(sc[g * WG + lane] - ms[g]);
            for (var r = 0u; r < DPL; r++) {
                acc[g * DPL + r] *= cs[g];
            }
        }
        workgroupBarrier();
        if (lane < HT) {
            var sum = 0.0;
            for (var j = 0u; j < n; j++) {
                sum += pw[lane * WG + j];
            }
            ls[lane] = ls[lane] * cs[lane] + sum;
        }
        for (var j = 0u; j < n; j++) {
            for (var r = 0u; r < DPL; r++) {
                let d = lane + r * WG;
                if (d < D) {
                    let v = v_deq(vc[j], vr[j], d);
                    for (var g = 0u; g < HT; g++) {
                        acc[g * DPL + r] += pw[g * WG + j] * v;
                    }
                }
            }
        }
        workgroupBarrier();
    }
    for (var g = 0u; g < HT; g++) {
        let base = (((row * prm.hq + h0 + g) * prm.parts) + p) * (D + 2u);
        for (var r = 0u; r < DPL; r++) {
            let d = lane + r * WG;
            if (d < D) {
                part[base + d] = acc[g * DPL + r];
            }
        }
        if (lane == 0u) {
            part[base + D] = ms[g];
            part[base + D + 1u] = ls[g];
        }
    }
}
