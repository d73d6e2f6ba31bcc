// Merge the partitions of each (query row, head): out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M)
const D: u32 = ${D}u;

struct Params { nx: u32, n: u32, parts: u32 }
@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> outp: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let rh = wid.x + wid.y * prm.nx;
    if (rh >= prm.n) {
        return;
    }
    let base = rh * prm.parts * (D + 2u);
    var mx = -3.0e38;
    for (var p = 0u; p < prm.parts; p++) {
        mx = max(mx, part[base + p * (D + 2u) + D]);
    }
    var l = 0.0;
    for (var p = 0u; p < prm.parts; p++) {
        let o = base + p * (D + 2u);
        l += part[o + D + 1u] * exp(part[o + D] - mx);
    }
    for (var d = lane; d < D; d += WG) {
        var acc = 0.0;
        for (var p = 0u; p < prm.parts; p++) {
            let o = base + p * (D + 2u);
            acc += part[o + d] * exp(part[o + D] - mx);
        }
        outp[rh * D + d] = acc / l;
    }
}
