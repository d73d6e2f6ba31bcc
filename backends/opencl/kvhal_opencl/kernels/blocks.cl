// Raw block I/O (read_blocks / write_blocks): whole pages between one pool and a staging buffer of
// blocks [n, stride] bytes, the page of listed block i at byte `at` of its staging row. One program per
// device, no shape defines: a work unit is one row of row_bytes bytes (rows_per_page per page), and
// work item g takes units [g*chunk, (g+1)*chunk) as in codec.cl.

kernel void gather_pages(global const uchar* pool, global const int* ids, int n_units, int chunk,
                         global uchar* blocks, int row_bytes, int rows_per_page, ulong stride, ulong at) {
    const int u0 = get_global_id(0) * chunk;
    const int u1 = min(n_units, u0 + chunk);
    for (int u = u0; u < u1; u++) {
        const int i = u / rows_per_page, r = u % rows_per_page;
        global const uchar* src = pool + ((ulong)ids[i] * rows_per_page + r) * row_bytes;
        global uchar* dst = blocks + i * stride + at + (ulong)r * row_bytes;
        for (int b = 0; b < row_bytes; b++) dst[b] = src[b];
    }
}

kernel void scatter_pages(global const uchar* blocks, global const int* ids, int n_units, int chunk,
                          global uchar* pool, int row_bytes, int rows_per_page, ulong stride, ulong at) {
    const int u0 = get_global_id(0) * chunk;
    const int u1 = min(n_units, u0 + chunk);
    for (int u = u0; u < u1; u++) {
        const int i = u / rows_per_page, r = u % rows_per_page;
        global const uchar* src = blocks + i * stride + at + (ulong)r * row_bytes;
        global uchar* dst = pool + ((ulong)ids[i] * rows_per_page + r) * row_bytes;
        for (int b = 0; b < row_bytes; b++) dst[b] = src[b];
    }
}
