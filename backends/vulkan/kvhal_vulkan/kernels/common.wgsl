// Bit-exact conversions and division in integer arithmetic.
//
// Vulkan lets f32 division be off by 2.5 ulp and lets drivers fuse a*b+c, and the WGSL pack/unpack
// builtins leave rounding and subnormals to the implementation. The pools must be byte-identical to
// kvhal/formats/ggml.py on every driver, so everything that decides a stored bit is done on u32 bits.

const NEG: f32 = -3.0e38;  // "minus infinity" for running maxima (WGSL has no inf literal)

// binary16 bits -> f32 (finite values), subnormals included: m * 2^-24 is exact in f32
fn f16_to_f32(h: u32) -> f32 {
    let s = (h & 0x8000u) << 16u;
    let em = h & 0x7fffu;
    let normal = s | ((em << 13u) + 0x38000000u);  // rebias the exponent by 127 - 15
    let sub = bitcast<u32>(f32(em) * 5.9604644775390625e-8) | s;
    return bitcast<f32>(select(normal, sub, em < 0x400u));
}

// f32 bits -> binary16 bits, round to nearest even (numpy's astype(float16))
fn f16_bits(u: u32) -> u32 {
    let s = (u >> 16u) & 0x8000u;
    let e32 = (u >> 23u) & 0xffu;
    let m = u & 0x7fffffu;
    if (e32 == 0xffu) {
        return s | 0x7c00u | select(0u, 0x200u, m != 0u);
    }
    let e = i32(e32) - 112;
    if (e >= 31) {
        return s | 0x7c00u;
    }
    if (e >= 1) {
        var h = (u32(e) << 10u) | (m >> 13u);
        let rest = m & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u) == 1u)) {
            h = h + 1u;  // a carry into the exponent is the correct rounding (up to inf)
        }
        return s | h;
    }
    if (e32 == 0u || e < -10) {
        return s;  // below half the smallest f16 subnormal
    }
    let sh = u32(14 - e);
    let mm = m | 0x800000u;
    var h = mm >> sh;
    let half = 1u << (sh - 1u);
    let rest = mm & ((half << 1u) - 1u);
    if (rest > half || (rest == half && (h & 1u) == 1u)) {
        h = h + 1u;
    }
    return s | h;
}

// f32 bits -> bfloat16 bits, as ggml_compute_fp32_to_bf16 (finite input)
fn bf16_bits(u: u32) -> u32 {
    return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}

// a / b correctly rounded (IEEE RNE, subnormals in and out), on f32 bit patterns; finite a, b != 0
fn div_rn(a: u32, b: u32) -> u32 {
    let s = (a ^ b) & 0x80000000u;
    var ea = i32((a >> 23u) & 0xffu);
    var eb = i32((b >> 23u) & 0xffu);
    var ma = a & 0x7fffffu;
    var mb = b & 0x7fffffu;
    if (ea == 0) {
        if (ma == 0u) {
            return s;
        }
        let sh = countLeadingZeros(ma) - 8u;
        ma = ma << sh;
        ea = 1 - i32(sh);
    } else {
        ma = ma | 0x800000u;
    }
    if (eb == 0) {
        let sh = countLeadingZeros(mb) - 8u;
        mb = mb << sh;
        eb = 1 - i32(sh);
    } else {
        mb = mb | 0x800000u;
    }
    if (ma < mb) {
        ma = ma << 1u;
        ea = ea - 1;
    }
    var e = ea - eb + 127;
    // restoring division: 25 quotient bits (24 of mantissa + 1 rounding bit), remainder = sticky
    var r = ma;
    var q = 0u;
    for (var i = 0u; i < 25u; i++) {
        q = q << 1u;
        if (r >= mb) {
            r = r - mb;
            q = q | 1u;
        }
        r = r << 1u;
    }
    var sh = 1u;
    if (e < 1) {
        sh = u32(2 - e);  // subnormal result: drop more bits
    }
    if (sh > 25u) {
        return s;
    }
    var m = q >> sh;
    let half = 1u << (sh - 1u);
    let rest = q & ((half << 1u) - 1u);
    if (rest > half || (rest == half && (r != 0u || (m & 1u) == 1u))) {
        m = m + 1u;
    }
    if (e < 1) {
        return s | m;  // a carry to 0x800000 is the smallest normal, as it should be
    }
    if (m == 0x1000000u) {
        m = m >> 1u;
        e = e + 1;
    }
    if (e >= 255) {
        return s | 0x7f800000u;
    }
    return s | (u32(e) << 23u) | (m & 0x7fffffu);
}

// ggml's id = d ? 1/d : 0, and 0 where 1/d overflows (kvhal/formats/ggml.py::_inverse)
fn inv_bits(d: u32) -> u32 {
    if ((d & 0x7fffffffu) == 0u) {
        return 0u;
    }
    let r = div_rn(0x3f800000u, d);
    if ((r & 0x7f800000u) == 0x7f800000u) {
        return 0u;
    }
    return r;
}

// floor(p + c) for f32 p (bits) and c = cf * 2^-25, in integers: the multiply that made p cannot be
// fused into this add by any driver. With ``rounded`` the sum is first rounded to f32, as numpy's
// float32 ``x*id + 8.5`` is; without, it is exact (C roundf's half-away rounding of q8_0). Needs
// p + c < 128; gives 0 below 0.5 (and below 0).
fn floor_add(pb: u32, cf: u32, rounded: bool) -> u32 {
    let e = (pb >> 23u) & 0xffu;
    var m = pb & 0x7fffffu;
    var ee = i32(e);
    if (e == 0u) {
        ee = 1;
    } else {
        m = m | 0x800000u;
    }
    // |p| in units of 2^-25, truncated; sticky: a nonzero remainder
    let sh = ee - 125;
    var big = 0u;
    var sticky = false;
    if (sh >= 0) {
        big = m << u32(sh);
    } else if (sh > -32) {
        big = m >> u32(-sh);
        sticky = (m & ((1u << u32(-sh)) - 1u)) != 0u;
    } else {
        sticky = m != 0u;
    }
    var a: u32;  // p + c = a + f units, 0 <= f < 1 and f > 0 iff sticky
    if ((pb >> 31u) == 0u) {
        a = cf + big;
    } else {
        let sub = big + select(0u, 1u, sticky);
        if (sub > cf) {
            return 0u;
        }
        a = cf - sub;
    }
    if (a < (1u << 24u)) {
        return 0u;
    }
    if (!rounded) {
        return a >> 25u;  // the remainder f < 1 unit cannot carry
    }
    // round a + f to 24 significant bits (ulp >= 2 units here), then floor
    let top = 31u - countLeadingZeros(a);
    let ulp = 1u << (top - 23u);
    let half = ulp >> 1u;
    let rem = a & (ulp - 1u);
    var r = a - rem;
    if (rem > half || (rem == half && (sticky || ((r >> (top - 23u)) & 1u) == 1u))) {
        r = r + ulp;
    }
    return r >> 25u;
}
