// block_q5_0 (22 bytes): f16 d; u32 qh (fifth bits, bit j = value j); u8 qs[16]
//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    let blk = row + (i / 32u) * 22u;
    let e = i % 32u;
    let lo = (${P}_b(c, blk + 6u + (e % 16u)) >> (4u * (e / 16u))) & 15u;
    let hi = (${P}_w(c, blk + 2u) >> e) & 1u;
    return f16_to_f32(${P}_h(c, blk)) * (f32(lo | (hi << 4u)) - 16.0);
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> f32 {
    var acc = 0.0;
    for (var b = 0u; b < D / 32u; b++) {
        let blk = row + b * 22u;
        let qh = ${P}_w(c, blk + 2u);
        var s = 0.0;
        for (var k = 0u; k < 4u; k++) {
            let w = ${P}_w(c, blk + 6u + 4u * k);
            for (var t = 0u; t < 4u; t++) {
                let e = 4u * k + t;
                let lo = ((w >> (8u * t)) & 15u) | (((qh >> e) & 1u) << 4u);
                let hi = ((w >> (8u * t + 4u)) & 15u) | (((qh >> (e + 16u)) & 1u) << 4u);
                s += (f32(lo) - 16.0) * qv[b * 32u + e];
                s += (f32(hi) - 16.0) * qv[b * 32u + e + 16u];
            }
        }
        acc += f16_to_f32(${P}_h(c, blk)) * s;
    }
    return acc;
}
//! quant
fn quant(lane: u32, nv: u32) {
    quant_absmax(lane, 0xc1800000u, 16.5, 31u);  // d = max / -16
    if (lane < 8u) {
        hw[3u + lane] = nibble_half(lane);
    }
    if (lane == 8u) {
        hw[0] = f16_bits(st[0]);
        let qh = high_bits();
        hw[1] = qh & 0xffffu;
        hw[2] = qh >> 16u;
    }
}
