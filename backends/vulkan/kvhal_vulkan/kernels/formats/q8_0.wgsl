// block_q8_0: f16 d; int8 qs[32]
//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    let blk = row + (i / Q8_0_LEN) * Q8_0_BYTES;
    let q = bitcast<i32>(${P}_b(c, blk + 2u + (i % Q8_0_LEN)) << 24u) >> 24u;
    return f16_to_f32(${P}_h(c, blk)) * f32(q);
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> array<f32, HT> {
    var acc = array<f32, HT>();
    for (var b = 0u; b < D / Q8_0_LEN; b++) {
        let blk = row + b * Q8_0_BYTES;
        var s = array<f32, HT>();  // explicit: naga zero-fills a loop-local `var s: T;` only once (gfx-rs/wgpu#9489)
        for (var k = 0u; k < 8u; k++) {
            let w = ${P}_w(c, blk + 2u + 4u * k);
            for (var t = 0u; t < 4u; t++) {
                let x = f32(bitcast<i32>(w << (24u - 8u * t)) >> 24u);
                let j = b * Q8_0_LEN + 4u * k + t;
                for (var g = 0u; g < HT; g++) {
                    s[g] += x * qv[g * D + j];
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
// C roundf: floor(|p| + 0.5) with the sum exact (0.49999997 rounds to 0), with p's sign
fn q8(p: f32) -> u32 {
    let b = bitcast<u32>(p);
    let r = floor_add(b & 0x7fffffffu, C0_5, false);
    return select(r, 0u - r, (b >> 31u) != 0u) & 0xffu;
}

fn quant(nv: u32) {
    var amax = 0u;  // |x| compared as bits: monotonic, immune to denormal flushing
    for (var j = 0u; j < Q8_0_LEN; j++) {
        amax = max(amax, x(j) & 0x7fffffffu);
    }
    let d = div_rn(amax, 0x42fe0000u);  // / 127
    let id = bitcast<f32>(inv_bits(d));
    put_half(0u, f16_bits(d));
    for (var j = 0u; j < Q8_0_LEN; j++) {
        put_byte(2u + j, q8(bitcast<f32>(x(j)) * id));
    }
}
