//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    return bitcast<f32>(${P}_w(c, row + 4u * i));
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> array<f32, HT> {
    var acc = array<f32, HT>();
    for (var i = 0u; i < D; i++) {
        let x = bitcast<f32>(${P}_w(c, row + 4u * i));
        for (var g = 0u; g < HT; g++) {
            acc[g] += x * qv[g * D + i];
        }
    }
    return acc;
}
//! quant
fn quant(nv: u32) {
    for (var j = 0u; j < nv; j++) {
        put_half(2u * j, x(j) & 0xffffu);
        put_half(2u * j + 1u, x(j) >> 16u);
    }
}
