//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    return f16_to_f32(${P}_h(c, row + 2u * i));
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> array<f32, HT> {
    var acc = array<f32, HT>();
    for (var i = 0u; i < D; i++) {
        let x = f16_to_f32(${P}_h(c, row + 2u * i));
        for (var g = 0u; g < HT; g++) {
            acc[g] += x * qv[g * D + i];
        }
    }
    return acc;
}
//! quant
fn quant(nv: u32) {
    for (var j = 0u; j < nv; j++) {
        put_half(j, f16_bits(x(j)));
    }
}
