// copy_slots, pass 2: write the gathered rows into the destination slots; words shared with a
// neighbouring row are updated with atomicAnd/atomicOr on this row's bytes only.
const H: u32 = ${H}u;
const BS: u32 = ${BS}u;
const PPC: u32 = ${PPC}u;
const RB: u32 = ${RB}u;
const RW: u32 = (RB + 3u) / 4u;

struct Params { nx: u32, n: u32, dst_off: u32, tmp_off: u32 }
@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> tab: array<u32>;
@group(0) @binding(2) var<storage, read> tmp: array<u32>;

${FORMAT}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let e = (wid.x + wid.y * prm.nx) * WG + lane;
    if (e >= prm.n * H) {
        return;
    }
    let h = e % H;
    let slot = tab[prm.dst_off + e / H];
    let blk = slot / BS;
    let c = blk / PPC;
    let s = (((blk % PPC) * H + h) * BS + slot % BS) * RB;
    let off = (s >> 1u) & 1u;
    let w0 = s >> 2u;
    let nh = RB / 2u;
    let nw = (off + nh + 1u) / 2u;
    let base = prm.tmp_off + e * RW;
    for (var w = 0u; w < nw; w++) {
        var val = 0u;
        var mask = 0u;
        for (var k = 0u; k < 2u; k++) {
            let j = i32(2u * w + k) - i32(off);
            if (j >= 0 && j < i32(nh)) {
                let half = (tmp[base + u32(j) / 2u] >> (16u * (u32(j) & 1u))) & 0xffffu;
                val = val | (half << (16u * k));
                mask = mask | (0xffffu << (16u * k));
            }
        }
        if (mask == 0xffffffffu) {
            p_st(c, w0 + w, val);
        } else {
            p_and(c, w0 + w, ~mask);
            p_or(c, w0 + w, val);
        }
    }
}
