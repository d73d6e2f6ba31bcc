// kvhal's ggml KV formats in OpenCL C 1.2, byte-identical to kvhal/formats/ggml.py (the spec).
//
// Needs no cl_khr_fp16: halves are only ever read and written through vload_half / vstore_half_rte.
// Compiled with -D HEAD_DIM=<values per row>, after the generated header of BLOCK_LEN_<fmt> and
// BLOCK_BYTES_<fmt> (kvhal_opencl/device.py::format_header). Per format FMT this file defines
//   UPR_FMT                      work units per row: one 32-value block, or the whole row for float formats
//   store_unit_FMT(x, dst, u)    quantize unit u of the float row x into the row bytes dst
//   load_unit_FMT(src, y, u)     dequantize unit u of the row bytes src into the float row y
//   dq32_FMT(row, c, &lo, &hi)   values 32c..32c+15 and 32c+16..32c+31 of a row, for attention
//   dq1_FMT(row, i)              value i of a row (float formats, for rows that are not 32-aligned)

// The quantizers must round exactly as numpy does: no fused multiply-add anywhere in store/load.
#pragma OPENCL FP_CONTRACT OFF

// every quantized format stores 32-value blocks, unpacked below as two 16-value halves
#define QK BLOCK_LEN_q8_0
#if QK != 32 || BLOCK_LEN_q4_0 != QK || BLOCK_LEN_q4_1 != QK || BLOCK_LEN_q5_0 != QK || BLOCK_LEN_q5_1 != QK
#error "formats.cl unpacks 32-value blocks; the format table has another block length"
#endif
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

#ifdef KVHAL_DIV_FP64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
// A correctly rounded double quotient rounded to float is the correctly rounded float quotient
// (53 >= 2*24 + 2), for devices without CL_FP_CORRECTLY_ROUNDED_DIVIDE_SQRT.
float div_rn(float a, float b) { return (float)((double)a / (double)b); }
#else
// built with -cl-fp32-correctly-rounded-divide-sqrt: IEEE division, as numpy's float32 '/'
float div_rn(float a, float b) { return a / b; }
#endif

// ggml's id = d ? 1/d : 0, and 0 where a subnormal d's inverse overflows (formats/ggml.py::_inverse)
float inverse(float d) {
    float inv = div_rn(1.0f, d);
    return (d == 0.0f || isinf(inv)) ? 0.0f : inv;
}

// C roundf (half away from zero). Not floor(|x| + 0.5f): that sum rounds 0.5 - 2^-25 up to 1. The
// fractional part |x| - trunc(|x|) is exact, so compare it with 0.5 instead.
float round_ref(float x) {
    float a = fabs(x), t = trunc(a);
    return copysign(t + (a - t >= 0.5f ? 1.0f : 0.0f), x);
}

void read_block(global const float* x, float* v) {
    for (int j = 0; j < QK; j++) v[j] = x[j];
}

// ggml's loop: the value of largest magnitude with its sign, first occurrence; starting from +0.0,
// so an all-zero block keeps +0.0 even when it holds -0.0
float signed_absmax(const float* v) {
    float best = 0.0f, amax = 0.0f;
    for (int j = 0; j < QK; j++) {
        if (fabs(v[j]) > amax) {
            amax = fabs(v[j]);
            best = v[j];
        }
    }
    return best;
}

// ggml's loop: first occurrence of the min / max under < and >, which decides the sign of a zero
// min/max in blocks holding both 0.0 and -0.0
void min_max(const float* v, float* lo, float* hi) {
    float a = v[0], b = v[0];
    for (int j = 1; j < QK; j++) {
        if (v[j] < a) a = v[j];
        if (v[j] > b) b = v[j];
    }
    *lo = a;
    *hi = b;
}

// value j in the low nibble, value j+16 in the high nibble of byte j
void pack_nibbles(const int* q, global uchar* qs) {
    for (int j = 0; j < QK / 2; j++) qs[j] = (uchar)((q[j] & 15) | ((q[j + QK / 2] & 15) << 4));
}

// fifth bits as a little-endian uint32, written bytewise: qh is only 2-aligned in q5_0
void pack_high_bits(const int* q, global uchar* qh) {
    uint bits = 0;
    for (int j = 0; j < QK; j++) bits |= (uint)((q[j] >> 4) & 1) << j;
    for (int b = 0; b < 4; b++) qh[b] = (uchar)(bits >> (8 * b));
}

uint read_u32(global const uchar* p) {
    return (uint)p[0] | ((uint)p[1] << 8) | ((uint)p[2] << 16) | ((uint)p[3] << 24);
}

float half_at(global const uchar* p) { return vload_half(0, (global const half*)p); }

// Attention reads halves through this instead: exact for every finite half (subnormals too) and
// vectorizable, where PoCL's vload_half is a scalar software routine. It needs float32 denormals
// (a half subnormal passes through a float32 subnormal), so FTZ devices build with KVHAL_FTZ.
#ifdef KVHAL_FTZ
float16 halves16(global const ushort* p) { return vload_half16(0, (global const half*)p); }
float half1(global const uchar* p) { return half_at(p); }
#else
float16 halves16(global const ushort* p) {
    const uint16 u = convert_uint16(vload16(0, p));
    const float16 mag = as_float16((u & (uint16)0x7fff) << (uint16)13) * 0x1p112f;
    return as_float16(as_uint16(mag) | ((u & (uint16)0x8000) << (uint16)16));
}
float half1(global const uchar* p) {
    const uint u = (uint)p[0] | ((uint)p[1] << 8);
    return as_float(as_uint(as_float((u & 0x7fff) << 13) * 0x1p112f) | ((u & 0x8000) << 16));
}
#endif

float16 nib_lo(uchar16 qs) { return convert_float16(qs & (uchar16)15); }
float16 nib_hi(uchar16 qs) { return convert_float16(qs >> (uchar16)4); }

// fifth bits of values 0..15 (shift 0) or 16..31 (shift 16), as 0 or 16
uint16 high_bits(uint qh, uint shift) {
    const uint16 lanes = (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return ((((uint16)qh) >> (lanes + (uint16)shift)) & (uint16)1) << (uint16)4;
}

// ---- f32: the float's bits, moved as integers so no device flushes subnormals ----------------------
#define UPR_f32 1
void store_unit_f32(global const float* x, global uchar* dst, int u) {
    for (int i = 0; i < HEAD_DIM; i++) ((global uint*)dst)[i] = as_uint(x[i]);
}
void load_unit_f32(global const uchar* src, global float* y, int u) {
    for (int i = 0; i < HEAD_DIM; i++) ((global uint*)y)[i] = ((global const uint*)src)[i];
}
float dq1_f32(global const uchar* row, int i) { return ((global const float*)row)[i]; }
void dq32_f32(global const uchar* row, int c, float16* lo, float16* hi) {
    *lo = vload16(2 * c, (global const float*)row);
    *hi = vload16(2 * c + 1, (global const float*)row);
}

// ---- f16: IEEE round to nearest even ---------------------------------------------------------------
#define UPR_f16 1
void store_unit_f16(global const float* x, global uchar* dst, int u) {
    for (int i = 0; i < HEAD_DIM; i++) vstore_half_rte(x[i], i, (global half*)dst);
}
void load_unit_f16(global const uchar* src, global float* y, int u) {
    for (int i = 0; i < HEAD_DIM; i++) y[i] = vload_half(i, (global const half*)src);
}
float dq1_f16(global const uchar* row, int i) { return half1(row + 2 * i); }
void dq32_f16(global const uchar* row, int c, float16* lo, float16* hi) {
    *lo = halves16((global const ushort*)row + 32 * c);
    *hi = halves16((global const ushort*)row + 32 * c + 16);
}

// ---- bf16: round to nearest even on the upper 16 bits, in integers ---------------------------------
#define UPR_bf16 1
void store_unit_bf16(global const float* x, global uchar* dst, int u) {
    for (int i = 0; i < HEAD_DIM; i++) {
        uint b = as_uint(x[i]);  // finite input: b + 0x8000 cannot wrap
        ((global ushort*)dst)[i] = (ushort)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    }
}
void load_unit_bf16(global const uchar* src, global float* y, int u) {
    for (int i = 0; i < HEAD_DIM; i++) ((global uint*)y)[i] = (uint)((global const ushort*)src)[i] << 16;
}
float dq1_bf16(global const uchar* row, int i) { return as_float((uint)((global const ushort*)row)[i] << 16); }
void dq32_bf16(global const uchar* row, int c, float16* lo, float16* hi) {
    *lo = as_float16(convert_uint16(vload16(2 * c, (global const ushort*)row)) << (uint16)16);
    *hi = as_float16(convert_uint16(vload16(2 * c + 1, (global const ushort*)row)) << (uint16)16);
}

// ---- q8_0: {f16 d; int8 qs[32]} -------------------------------------------------------------------
#define UPR_q8_0 (HEAD_DIM / BLOCK_LEN_q8_0)
void store_unit_q8_0(global const float* x, global uchar* dst, int u) {
    float v[QK];
    read_block(x + u * QK, v);
    dst += u * BLOCK_BYTES_q8_0;
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmax(amax, fabs(v[j]));
    const float d = div_rn(amax, 127.0f);
    const float id = inverse(d);
    vstore_half_rte(d, 0, (global half*)dst);
    for (int j = 0; j < QK; j++) ((global char*)dst)[2 + j] = (char)round_ref(v[j] * id);
}
void load_unit_q8_0(global const uchar* src, global float* y, int u) {
    src += u * BLOCK_BYTES_q8_0;
    y += u * QK;
    const float d = half_at(src);
    for (int j = 0; j < QK; j++) y[j] = d * (float)((global const char*)src)[2 + j];
}
void dq32_q8_0(global const uchar* row, int c, float16* lo, float16* hi) {
    global const uchar* b = row + c * BLOCK_BYTES_q8_0;
    const float d = half1(b);
    *lo = d * convert_float16(vload16(0, (global const char*)(b + 2)));
    *hi = d * convert_float16(vload16(1, (global const char*)(b + 2)));
}

// ---- q4_0: {f16 d; u8 qs[16]} ---------------------------------------------------------------------
#define UPR_q4_0 (HEAD_DIM / BLOCK_LEN_q4_0)
void store_unit_q4_0(global const float* x, global uchar* dst, int u) {
    float v[QK];
    int q[QK];
    read_block(x + u * QK, v);
    dst += u * BLOCK_BYTES_q4_0;
    const float d = div_rn(signed_absmax(v), -8.0f);
    const float id = inverse(d);
    for (int j = 0; j < QK; j++) q[j] = min((int)(v[j] * id + 8.5f), 15);  // >= 0: (int) truncates
    vstore_half_rte(d, 0, (global half*)dst);
    pack_nibbles(q, dst + 2);
}
void load_unit_q4_0(global const uchar* src, global float* y, int u) {
    src += u * BLOCK_BYTES_q4_0;
    y += u * QK;
    const float d = half_at(src);
    for (int j = 0; j < QK / 2; j++) {
        y[j] = d * ((float)(src[2 + j] & 15) - 8.0f);
        y[j + QK / 2] = d * ((float)(src[2 + j] >> 4) - 8.0f);
    }
}
void dq32_q4_0(global const uchar* row, int c, float16* lo, float16* hi) {
    global const uchar* b = row + c * BLOCK_BYTES_q4_0;
    const float d = half1(b);
    const uchar16 qs = vload16(0, b + 2);
    *lo = d * (nib_lo(qs) - 8.0f);
    *hi = d * (nib_hi(qs) - 8.0f);
}

// ---- q4_1: {f16 d; f16 m; u8 qs[16]} --------------------------------------------------------------
#define UPR_q4_1 (HEAD_DIM / BLOCK_LEN_q4_1)
void store_unit_q4_1(global const float* x, global uchar* dst, int u) {
    float v[QK], lo, hi;
    int q[QK];
    read_block(x + u * QK, v);
    dst += u * BLOCK_BYTES_q4_1;
    min_max(v, &lo, &hi);
    const float d = div_rn(hi - lo, 15.0f);
    const float id = inverse(d);
    for (int j = 0; j < QK; j++) q[j] = min((int)((v[j] - lo) * id + 0.5f), 15);
    vstore_half_rte(d, 0, (global half*)dst);
    vstore_half_rte(lo, 1, (global half*)dst);
    pack_nibbles(q, dst + 4);
}
void load_unit_q4_1(global const uchar* src, global float* y, int u) {
    src += u * BLOCK_BYTES_q4_1;
    y += u * QK;
    const float d = half_at(src), m = half_at(src + 2);
    for (int j = 0; j < QK / 2; j++) {
        y[j] = d * (float)(src[4 + j] & 15) + m;
        y[j + QK / 2] = d * (float)(src[4 + j] >> 4) + m;
    }
}
void dq32_q4_1(global const uchar* row, int c, float16* lo, float16* hi) {
    global const uchar* b = row + c * BLOCK_BYTES_q4_1;
    const float d = half1(b), m = half1(b + 2);
    const uchar16 qs = vload16(0, b + 4);
    *lo = d * nib_lo(qs) + m;
    *hi = d * nib_hi(qs) + m;
}

// ---- q5_0: {f16 d; u32 qh; u8 qs[16]} -------------------------------------------------------------
#define UPR_q5_0 (HEAD_DIM / BLOCK_LEN_q5_0)
void store_unit_q5_0(global const float* x, global uchar* dst, int u) {
    float v[QK];
    int q[QK];
    read_block(x + u * QK, v);
    dst += u * BLOCK_BYTES_q5_0;
    const float d = div_rn(signed_absmax(v), -16.0f);
    const float id = inverse(d);
    for (int j = 0; j < QK; j++) q[j] = min((int)(v[j] * id + 16.5f), 31);
    vstore_half_rte(d, 0, (global half*)dst);
    pack_high_bits(q, dst + 2);
    pack_nibbles(q, dst + 6);
}
void load_unit_q5_0(global const uchar* src, global float* y, int u) {
    src += u * BLOCK_BYTES_q5_0;
    y += u * QK;
    const float d = half_at(src);
    const uint qh = read_u32(src + 2);
    for (int j = 0; j < QK / 2; j++) {
        const int a = (src[6 + j] & 15) | (((qh >> j) & 1) << 4);
        const int b = (src[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = d * ((float)a - 16.0f);
        y[j + QK / 2] = d * ((float)b - 16.0f);
    }
}
void dq32_q5_0(global const uchar* row, int c, float16* lo, float16* hi) {
    global const uchar* b = row + c * BLOCK_BYTES_q5_0;
    const float d = half1(b);
    const uint qh = read_u32(b + 2);
    const uchar16 qs = vload16(0, b + 6);
    *lo = d * (convert_float16(convert_uint16(qs & (uchar16)15) | high_bits(qh, 0)) - 16.0f);
    *hi = d * (convert_float16(convert_uint16(qs >> (uchar16)4) | high_bits(qh, 16)) - 16.0f);
}

// ---- q5_1: {f16 d; f16 m; u32 qh; u8 qs[16]} ------------------------------------------------------
#define UPR_q5_1 (HEAD_DIM / BLOCK_LEN_q5_1)
void store_unit_q5_1(global const float* x, global uchar* dst, int u) {
    float v[QK], lo, hi;
    int q[QK];
    read_block(x + u * QK, v);
    dst += u * BLOCK_BYTES_q5_1;
    min_max(v, &lo, &hi);
    const float d = div_rn(hi - lo, 31.0f);
    const float id = inverse(d);
    for (int j = 0; j < QK; j++) q[j] = min((int)((v[j] - lo) * id + 0.5f), 31);
    vstore_half_rte(d, 0, (global half*)dst);
    vstore_half_rte(lo, 1, (global half*)dst);
    pack_high_bits(q, dst + 4);
    pack_nibbles(q, dst + 8);
}
void load_unit_q5_1(global const uchar* src, global float* y, int u) {
    src += u * BLOCK_BYTES_q5_1;
    y += u * QK;
    const float d = half_at(src), m = half_at(src + 2);
    const uint qh = read_u32(src + 4);
    for (int j = 0; j < QK / 2; j++) {
        const int a = (src[8 + j] & 15) | (((qh >> j) & 1) << 4);
        const int b = (src[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = d * (float)a + m;
        y[j + QK / 2] = d * (float)b + m;
    }
}
void dq32_q5_1(global const uchar* row, int c, float16* lo, float16* hi) {
    global const uchar* b = row + c * BLOCK_BYTES_q5_1;
    const float d = half1(b), m = half1(b + 2);
    const uint qh = read_u32(b + 4);
    const uchar16 qs = vload16(0, b + 8);
    *lo = d * convert_float16(convert_uint16(qs & (uchar16)15) | high_bits(qh, 0)) + m;
    *hi = d * convert_float16(convert_uint16(qs >> (uchar16)4) | high_bits(qh, 16)) + m;
}
