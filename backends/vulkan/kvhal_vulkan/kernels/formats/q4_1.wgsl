// block_q4_1 (20 bytes): f16 d; f16 m; u8 qs[16]
//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    let blk = row + (i / 32u) * 20u;
    let e = i % 32u;
    let q = (${P}_b(c, blk + 4u + (e % 16u)) >> (4u * (e / 16u))) & 15u;
    return f16_to_f32(${P}_h(c, blk)) * f32(q) + f16_to_f32(${P}_h(c, blk + 2u));
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> f32 {
    var acc = 0.0;
    for (var b = 0u; b < D / 32u; b++) {
        let blk = row + b * 20u;
        var s = 0.0;
        var qsum = 0.0;
        for (var k = 0u; k < 4u; k++) {
            let w = ${P}_w(c, blk + 4u + 4u * k);
            for (var t = 0u; t < 4u; t++) {
                let j = b * 32u + 4u * k + t;
                s += f32((w >> (8u * t)) & 15u) * qv[j] + f32((w >> (8u * t + 4u)) & 15u) * qv[j + 16u];
                qsum += qv[j] + qv[j + 16u];
            }
        }
        acc += f16_to_f32(${P}_h(c, blk)) * s + f16_to_f32(${P}_h(c, blk + 2u)) * qsum;
    }
    return acc;
}
//! quant
fn quant(lane: u32, nv: u32) {
    quant_minmax(lane, 0x41700000u, 15u);  // d = (max - min) / 15
    if (lane < 8u) {
        hw[2u + lane] = nibble_half(lane);
    }
    if (lane == 8u) {
        hw[0] = f16_bits(st[0]);
        hw[1] = f16_bits(st[2]);
    }
}
