//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    return bitcast<f32>(${P}_h(c, row + 2u * i) << 16u);
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> array<f32, HT> {
    var acc = array<f32, HT>();
    for (var i = 0u; i + 1u < D; i += 2u) {  // two values per (possibly unaligned) word read
        let w = ${P}_w(c, row + 2u * i);
        let x0 = bitcast<f32>(w << 16u);
        let x1 = bitcast<f32>(w & 0xffff0000u);
        for (var g = 0u; g < HT; g++) {
            acc[g] += x0 * qv[g * D + i] + x1 * qv[g * D + i + 1u];
        }
    }
    if ((D & 1u) == 1u) {
        let x = bitcast<f32>(${P}_h(c, row + 2u * (D - 1u)) << 16u);
        for (var g = 0u; g < HT; g++) {
            acc[g] += x * qv[g * D + D - 1u];
        }
    }
    return acc;
}
//! quant
fn quant(nv: u32) {
    for (var j = 0u; j < nv; j++) {
        put_half(j, bf16_bits(x(j)));
    }
}
