//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    return f16_to_f32(${P}_h(c, row + 2u * i));
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> f32 {
    var acc = 0.0;
    for (var i = 0u; i < D; i++) {
        acc += f16_to_f32(${P}_h(c, row + 2u * i)) * qv[i];
    }
    return acc;
}
//! quant
fn quant(lane: u32, nv: u32) {
    if (lane < nv) {
        hw[lane] = f16_bits(xb[lane]);
    }
}
