// block_q5_0: f16 d; u32 qh (fifth bits, bit j = value j); u8 qs[16]
//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    let blk = row + (i / Q5_0_LEN) * Q5_0_BYTES;
    let e = i % Q5_0_LEN;
    let lo = (${P}_b(c, blk + 6u + (e % 16u)) >> (4u * (e / 16u))) & 15u;
    let hi = (${P}_w(c, blk + 2u) >> e) & 1u;
    return f16_to_f32(${P}_h(c, blk)) * (f32(lo | (hi << 4u)) - 16.0);
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> array<f32, HT> {
    var acc = array<f32, HT>();
    for (var b = 0u; b < D / Q5_0_LEN; b++) {
        let blk = row + b * Q5_0_BYTES;
        let qh = ${P}_w(c, blk + 2u);
        var s = array<f32, HT>();  // explicit: naga zero-fills a loop-local `var s: T;` only once (gfx-rs/wgpu#9489)
        for (var k = 0u; k < 4u; k++) {
            let w = ${P}_w(c, blk + 6u + 4u * k);
            for (var t = 0u; t < 4u; t++) {
                let e = 4u * k + t;
                let lo = f32(((w >> (8u * t)) & 15u) | (((qh >> e) & 1u) << 4u)) - 16.0;
                let hi = f32(((w >> (8u * t + 4u)) & 15u) | (((qh >> (e + 16u)) & 1u) << 4u)) - 16.0;
                for (var g = 0u; g < HT; g++) {
                    s[g] += lo * qv[g * D + b * Q5_0_LEN + e] + hi * qv[g * D + b * Q5_0_LEN + e + 16u];
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
    let d = div_rn(signed_absmax(), 0xc1800000u);  // / -16
    let id = bitcast<f32>(inv_bits(d));
    var qh = 0u;
    for (var k = 0u; k < 16u; k++) {
        let a = q_sym(x(k), id, C16_5, 31u);
        let b = q_sym(x(k + 16u), id, C16_5, 31u);
        put_byte(6u + k, (a & 15u) | ((b & 15u) << 4u));
        qh = qh | ((a >> 4u) << k) | ((b >> 4u) << (k + 16u));
    }
    put_half(0u, f16_bits(d));
    put_half(1u, qh & 0xffffu);
    put_half(2u, qh >> 16u);
}
