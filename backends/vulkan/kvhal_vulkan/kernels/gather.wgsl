// copy_slots, pass 1: gather the source rows (bytes as stored) into word-aligned scratch rows
const H: u32 = ${H}u;
const BS: u32 = ${BS}u;
const PPC: u32 = ${PPC}u;
const RB: u32 = ${RB}u;
const RW: u32 = (RB + 3u) / 4u;

struct Params { nx: u32, n: u32, src_off: u32, tmp_off: u32 }
@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> tab: array<u32>;
@group(0) @binding(2) var<storage, read_write> tmp: array<u32>;

${FORMAT}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let e = (wid.x + wid.y * prm.nx) * WG + lane;
    if (e >= prm.n * H * RW) {
        return;
    }
    let w = e % RW;
    let h = (e / RW) % H;
    let slot = tab[prm.src_off + e / (RW * H)];
    let blk = slot / BS;
    let row = (((blk % PPC) * H + h) * BS + slot % BS) * RB;
    let c = blk / PPC;
    var val = p_h(c, row + 4u * w);
    if (4u * w + 2u < RB) {
        val = val | (p_h(c, row + 4u * w + 2u) << 16u);
    }
    tmp[prm.tmp_off + e] = val;
}
