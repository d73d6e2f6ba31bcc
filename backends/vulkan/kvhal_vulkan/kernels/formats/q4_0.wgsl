// block_q4_0: f16 d; u8 qs[16] (value j in the low nibble of byte j, j+16 in the high)
//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    let blk = row + (i / Q4_0_LEN) * Q4_0_BYTES;
    let e = i % Q4_0_LEN;
    let q = (${P}_b(c, blk + 2u + (e % 16u)) >> (4u * (e / 16u))) & 15u;
    return f16_to_f32(${P}_h(c, blk)) * (f32(q) - 8.0);
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> array<f32, HT> {
    var acc = array<f32, HT>();
    for (var b = 0u; b < D / Q4_0_LEN; b++) {
        let blk = row + b * Q4_0_BYTES;
        var s = array<f32, HT>();  // explicit: naga zero-fills a loop-local `var s: T;` only once (gfx-rs/wgpu#9489)
        for (var k = 0u; k < 4u; k++) {
            let w = ${P}_w(c, blk + 2u + 4u * k);
            for (var t = 0u; t < 4u; t++) {
                let e = 4u * k + t;
                let lo = f32((w >> (8u * t)) & 15u) - 8.0;
                let hi = f32((w >> (8u * t + 4u)) & 15u) - 8.0;
                for (var g = 0u; g < HT; g++) {
                    s[g] += lo * qv[g * D + b * Q4_0_LEN + e] + hi * qv[g * D + b * Q4_0_LEN + e + 16u];
                }
            }
        }
        let d = f16_to_f32(${P}_h(c, blk));
        for (var g = 0u; g < HT; g++) {
            acc[g] += d * s[g];
        }
    }
    return acc;
}
//! quant
fn quant(nv: u32) {
    let d = div_rn(signed_absmax(), 0xc1000000u);  // / -8
    let id = bitcast<f32>(inv_bits(d));
    put_half(0u, f16_bits(d));
    for (var k = 0u; k < 16u; k++) {
        put_byte(2u + k, q_sym(x(k), id, C8_5, 15u) | (q_sym(x(k + 16u), id, C8_5, 15u) << 4u));
    }
}
