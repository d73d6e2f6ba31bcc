// load: gather pages and dequantize, one invocation per output value
const D: u32 = ${D}u;
const H: u32 = ${H}u;
const BS: u32 = ${BS}u;
const PPC: u32 = ${PPC}u;
const RB: u32 = ${RB}u;

struct Params { nx: u32, n: u32, ids_off: u32, out_off: u32 }
@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> tab: array<u32>;
@group(0) @binding(2) var<storage, read_write> outp: array<f32>;

${FORMAT}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let e = (wid.x + wid.y * prm.nx) * WG + lane;
    if (e >= prm.n * H * D) {
        return;
    }
    let d = e % D;
    let h = (e / D) % H;
    let i = e / (D * H);
    let page = tab[prm.ids_off + i / BS];
    let row = (((page % PPC) * H + h) * BS + i % BS) * RB;
    outp[prm.out_off + e] = p_deq(page / PPC, row, d);
}
