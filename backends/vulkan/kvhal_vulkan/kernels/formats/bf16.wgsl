//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    return bitcast<f32>(${P}_h(c, row + 2u * i) << 16u);
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> f32 {
    var acc = 0.0;
    for (var i = 0u; i < D; i++) {
        acc += bitcast<f32>(${P}_h(c, row + 2u * i) << 16u) * qv[i];
    }
    return acc;
}
//! quant
fn quant(lane: u32, nv: u32) {
    if (lane < nv) {
        hw[lane] = bf16_bits(xb[lane]);
    }
}
