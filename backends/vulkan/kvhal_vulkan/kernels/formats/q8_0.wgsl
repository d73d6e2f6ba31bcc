// block_q8_0 (34 bytes): f16 d; int8 qs[32]
//! deq
fn ${P}_deq(c: u32, row: u32, i: u32) -> f32 {
    let blk = row + (i / 32u) * 34u;
    let q = bitcast<i32>(${P}_b(c, blk + 2u + (i % 32u)) << 24u) >> 24u;
    return f16_to_f32(${P}_h(c, blk)) * f32(q);
}
//! dot
fn ${P}_dot(c: u32, row: u32) -> f32 {
    var acc = 0.0;
    for (var b = 0u; b < D / 32u; b++) {
        let blk = row + b * 34u;
        var s = 0.0;
        for (var k = 0u; k < 8u; k++) {
            let w = ${P}_w(c, blk + 2u + 4u * k);
            let j = b * 32u + 4u * k;
            s += f32(bitcast<i32>(w << 24u) >> 24u) * qv[j];
            s += f32(bitcast<i32>(w << 16u) >> 24u) * qv[j + 1u];
            s += f32(bitcast<i32>(w << 8u) >> 24u) * qv[j + 2u];
            s += f32(bitcast<i32>(w) >> 24u) * qv[j + 3u];
        }
        acc += f16_to_f32(${P}_h(c, blk)) * s;
    }
    return acc;
}
//! quant
fn quant(lane: u32, nv: u32) {
    if (lane == 0u) {
        var amax = 0u;  // |x| compared as bits: monotonic, and immune to denormal flushing
        for (var j = 0u; j < 32u; j++) {
            amax = max(amax, xb[j] & 0x7fffffffu);
        }
        let d = div_rn(amax, 0x42fe0000u);  // / 127
        st[0] = d;
        st[1] = inv_bits(d);
    }
    workgroupBarrier();
    ps[lane] = bitcast<f32>(xb[lane]) * bitcast<f32>(st[1]);
    workgroupBarrier();
    // round a neighbour's product: a product written by another invocation cannot be fused into
    // the add (roundf as the reference computes it: floor(|p| + 0.5) in f32, with p's sign)
    let j = lane ^ 1u;
    let p = ps[j];
    var q = i32(floor(abs(p) + 0.5));
    if (p < 0.0) {
        q = -q;
    }
    qs[j] = u32(q) & 0xffu;
    workgroupBarrier();
    if (lane < 16u) {
        hw[1u + lane] = qs[2u * lane] | (qs[2u * lane + 1u] << 8u);
    }
    if (lane == 16u) {
        hw[0] = f16_bits(st[0]);
    }
}
