// block_q5_1 (24 bytes): f16 d; f16 m; u32 qh; u8 qs[16]
//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    let blk = row + (i / 32u) * 24u;
    let e = i % 32u;
    let lo = (${P}_b(c, blk + 8u + (e % 16u)) >> (4u * (e / 16u))) & 15u;
    let hi = (${P}_w(c, blk + 4u) >> e) & 1u;
    return f16_to_f32(${P}_h(c, blk)) * f32(lo | (hi << 4u)) + f16_to_f32(${P}_h(c, blk + 2u));
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> f32 {
    var acc = 0.0;
    for (var b = 0u; b < D / 32u; b++) {
        let blk = row + b * 24u;
        let qh = ${P}_w(c, blk + 4u);
        var s = 0.0;
        var qsum = 0.0;
        for (var k = 0u; k < 4u; k++) {
            let w = ${P}_w(c, blk + 8u + 4u * k);
            for (var t = 0u; t < 4u; t++) {
                let e = 4u * k + t;
                let lo = ((w >> (8u * t)) & 15u) | (((qh >> e) & 1u) << 4u);
                let hi = ((w >> (8u * t + 4u)) & 15u) | (((qh >> (e + 16u)) & 1u) << 4u);
                let j = b * 32u + e;
                s += f32(lo) * qv[j] + f32(hi) * qv[j + 16u];
                qsum += qv[j] + qv[j + 16u];
            }
        }
        acc += f16_to_f32(${P}_h(c, blk)) * s + f16_to_f32(${P}_h(c, blk + 2u)) * qsum;
    }
    return acc;
}
//! quant
fn quant(lane: u32, nv: u32) {
    quant_minmax(lane, 0x41f80000u, 31u);  // d = (max - min) / 31
    if (lane < 8u) {
        hw[4u + lane] = nibble_half(lane);
    }
    if (lane == 8u) {
        hw[0] = f16_bits(st[0]);
        hw[1] = f16_bits(st[2]);
        let qh = high_bits();
        hw[2] = qh & 0xffffu;
        hw[3] = qh >> 16u;
    }
}
