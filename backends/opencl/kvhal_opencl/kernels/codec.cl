// store / load / copy_slots for one pool, appended to formats.cl and compiled once per
// (device, FMT, HEAD_DIM, N_KV_HEADS, BLOCK_SIZE, ROW_BYTES).
//
// Pool layout (kvhal/backend.py): [n_blocks, N_KV_HEADS, BLOCK_SIZE, ROW_BYTES] bytes; slot = block*BLOCK_SIZE + offset.
// Every kernel walks a flat index space of work units; work item g takes the contiguous range
// [g*chunk, (g+1)*chunk): chunk 1 on GPUs, one large chunk per work item on CPUs (PoCL reaches memory
// bandwidth only with contiguous per-item ranges, not with grid-stride loops).

#define UPR CAT(UPR_, FMT)
#define STORE_UNIT CAT(store_unit_, FMT)
#define LOAD_UNIT CAT(load_unit_, FMT)

// byte offset of (slot, head) in the pool
ulong row_offset(int slot, int head) {
    return (((ulong)(slot / BLOCK_SIZE) * N_KV_HEADS + head) * BLOCK_SIZE + slot % BLOCK_SIZE) * ROW_BYTES;
}

// x: [n, N_KV_HEADS, HEAD_DIM] f32; token i goes to slots[i]
kernel void store_rows(global const float* x, global const int* slots, int n_units, int chunk, global uchar* pool) {
    const int u0 = get_global_id(0) * chunk;
    const int u1 = min(n_units, u0 + chunk);
    for (int u = u0; u < u1; u++) {
        const int r = u / UPR;  // token * N_KV_HEADS + head
        STORE_UNIT(x + (ulong)r * HEAD_DIM, pool + row_offset(slots[r / N_KV_HEADS], r % N_KV_HEADS), u % UPR);
    }
}

// y: [n, N_KV_HEADS, HEAD_DIM] f32 from the first n tokens of the pages block_ids
kernel void load_rows(global const uchar* pool, global const int* block_ids, int n_units, int chunk, global float* y) {
    const int u0 = get_global_id(0) * chunk;
    const int u1 = min(n_units, u0 + chunk);
    for (int u = u0; u < u1; u++) {
        const int r = u / UPR;
        const int t = r / N_KV_HEADS;
        const int slot = block_ids[t / BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE;
        LOAD_UNIT(pool + row_offset(slot, r % N_KV_HEADS), y + (ulong)r * HEAD_DIM, u % UPR);
    }
}

// copy_slots runs gather then scatter (two launches on one in-order queue): src and dst may overlap.
// rows: [n, N_KV_HEADS, ROW_BYTES] bytes
kernel void gather_rows(global const uchar* pool, global const int* slots, int n_rows, int chunk, global uchar* rows) {
    const int r0 = get_global_id(0) * chunk;
    const int r1 = min(n_rows, r0 + chunk);
    for (int r = r0; r < r1; r++) {
        global const uchar* src = pool + row_offset(slots[r / N_KV_HEADS], r % N_KV_HEADS);
        global uchar* dst = rows + (ulong)r * ROW_BYTES;
        for (int b = 0; b < ROW_BYTES; b++) dst[b] = src[b];
    }
}

kernel void scatter_rows(global const uchar* rows, global const int* slots, int n_rows, int chunk, global uchar* pool) {
    const int r0 = get_global_id(0) * chunk;
    const int r1 = min(n_rows, r0 + chunk);
    for (int r = r0; r < r1; r++) {
        global const uchar* src = rows + (ulong)r * ROW_BYTES;
        global uchar* dst = pool + row_offset(slots[r / N_KV_HEADS], r % N_KV_HEADS);
        for (int b = 0; b < ROW_BYTES; b++) dst[b] = src[b];
    }
}
