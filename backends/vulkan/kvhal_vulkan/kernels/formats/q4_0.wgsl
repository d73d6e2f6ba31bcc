// block_q4_0 (18 bytes): f16 d; u8 qs[16] (value j in the low nibble of byte j, j+16 in the high)
//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    let blk = row + (i / 32u) * 18u;
    let e = i % 32u;
    let q = (${P}_b(c, blk + 2u + (e % 16u)) >> (4u * (e / 16u))) & 15u;
    return f16_to_f32(${P}_h(c, blk)) * (f32(q) - 8.0);
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> f32 {
    var acc = 0.0;
    for (var b = 0u; b < D / 32u; b++) {
        let blk = row + b * 18u;
        var s = 0.0;
        for (var k = 0u; k < 4u; k++) {
            let w = ${P}_w(c, blk + 2u + 4u * k);
            for (var t = 0u; t < 4u; t++) {
                let j = b * 32u + 4u * k + t;
                s += (f32((w >> (8u * t)) & 15u) - 8.0) * qv[j];
                s += (f32((w >> (8u * t + 4u)) & 15u) - 8.0) * qv[j + 16u];
            }
        }
        acc += f16_to_f32(${P}_h(c, blk)) * s;
    }
    return acc;
}
//! quant
fn quant(lane: u32, nv: u32) {
    quant_absmax(lane, 0xc1000000u, 8.5, 15u);  // d = max / -8
    if (lane < 8u) {
        hw[1u + lane] = nibble_half(lane);
    }
    if (lane == 8u) {
        hw[0] = f16_bits(st[0]);
    }
}
