// block_q4_1: f16 d; f16 m; u8 qs[16]
//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    let blk = row + (i / Q4_1_LEN) * Q4_1_BYTES;
    let e = i % Q4_1_LEN;
    let q = (${P}_b(c, blk + 4u + (e % 16u)) >> (4u * (e / 16u))) & 15u;
    return f16_to_f32(${P}_h(c, blk)) * f32(q) + f16_to_f32(${P}_h(c, blk + 2u));
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> array<f32, HT> {
    var acc = array<f32, HT>();
    for (var b = 0u; b < D / Q4_1_LEN; b++) {
        let blk = row + b * Q4_1_BYTES;
        var s = array<f32, HT>();  // explicit: naga zero-fills a loop-local `var s: T;` only once (gfx-rs/wgpu#9489)
        for (var k = 0u; k < 4u; k++) {
            let w = ${P}_w(c, blk + 4u + 4u * k);
            for (var t = 0u; t < 4u; t++) {
                let e = 4u * k + t;
                let lo = f32((w >> (8u * t)) & 15u);
                let hi = f32((w >> (8u * t + 4u)) & 15u);
                for (var g = 0u; g < HT; g++) {
                    s[g] += lo * qv[g * D + b * Q4_1_LEN + e] + hi * qv[g * D + b * Q4_1_LEN + e + 16u];
                }
            }
        }
        let d = f16_to_f32(${P}_h(c, blk));
        let m = f16_to_f32(${P}_h(c, blk + 2u));
        for (var g = 0u; g < HT; g++) {
            acc[g] += d * s[g] + m * qbs[g * NB + b];
        }
    }
    return acc;
}
//! quant
fn quant(nv: u32) {
    let mm = min_max();
    let d = div_rn(bitcast<u32>(mm.y - mm.x), 0x41700000u);  // / 15
    let id = bitcast<f32>(inv_bits(d));
    put_half(0u, f16_bits(d));
    put_half(1u, f16_bits(bitcast<u32>(mm.x)));
    for (var k = 0u; k < 16u; k++) {
        put_byte(4u + k, q_min(x(k), mm.x, id, 15u) | (q_min(x(k + 16u), mm.x, id, 15u) << 4u));
    }
}
