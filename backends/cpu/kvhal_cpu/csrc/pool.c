/* A small persistent pthread pool: one job at a time, tasks handed out by an atomic counter, the
 * calling thread works too. Workers spin briefly after a job (decode steps come back-to-back) and
 * then sleep on a condition variable, so an idle backend costs no CPU on a shared machine. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "kvcpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define SPIN_ITERS 4000 /* a few hundred microseconds of pause */

static struct {
    pthread_mutex_t job_lock; /* one job at a time across caller threads */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    pthread_t *threads;
    int n_workers;
    _Atomic uint64_t gen;
    _Atomic int64_t next;
    _Atomic int pending;
    _Atomic int shutdown;
    kv_task_fn fn;
    void *ctx;
    int64_t n_tasks;
    uint64_t spawn_gen;
} P = {.job_lock = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER, .cv_work = PTHREAD_COND_INITIALIZER,
       .cv_done = PTHREAD_COND_INITIALIZER};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void run_tasks(int worker) {
    for (;;) {
        int64_t t = atomic_fetch_add_explicit(&P.next, 1, memory_order_relaxed);
        if (t >= P.n_tasks) break;
        P.fn(P.ctx, t, worker);
    }
}

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    /* the generation before this worker's first job: it may start after that job was posted */
    uint64_t seen = P.spawn_gen;
    for (;;) {
        int i = 0;
        while (atomic_load_explicit(&P.gen, memory_order_acquire) == seen && i < SPIN_ITERS) {
            CPU_RELAX();
            i++;
        }
        if (atomic_load_explicit(&P.gen, memory_order_acquire) == seen) {
            pthread_mutex_lock(&P.mu);
            while (atomic_load_explicit(&P.gen, memory_order_acquire) == seen && !atomic_load(&P.shutdown))
                pthread_cond_wait(&P.cv_work, &P.mu);
            pthread_mutex_unlock(&P.mu);
        }
        if (atomic_load(&P.shutdown)) return NULL;
        seen = atomic_load_explicit(&P.gen, memory_order_acquire);
        run_tasks(id);
        if (atomic_fetch_sub_explicit(&P.pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&P.mu);
            pthread_cond_signal(&P.cv_done);
            pthread_mutex_unlock(&P.mu);
        }
    }
}

static void stop_workers(void) {
    if (!P.n_workers) return;
    pthread_mutex_lock(&P.mu);
    atomic_store(&P.shutdown, 1);
    pthread_cond_broadcast(&P.cv_work);
    pthread_mutex_unlock(&P.mu);
    for (int i = 0; i < P.n_workers; i++) pthread_join(P.threads[i], NULL);
    free(P.threads);
    P.threads = NULL;
    P.n_workers = 0;
    atomic_store(&P.shutdown, 0);
}

/* the child of fork() has none of the parent's threads: start from an empty pool */
static void atfork_prepare(void) { pthread_mutex_lock(&P.job_lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&P.job_lock); }
static void atfork_child(void) {
    P.threads = NULL;
    P.n_workers = 0;
    atomic_store(&P.shutdown, 0);
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.cv_work, NULL);
    pthread_cond_init(&P.cv_done, NULL);
    pthread_mutex_init(&P.job_lock, NULL);
}
static void install_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

static int resize(int n_workers) {
    if (n_workers == P.n_workers) return 0;
    stop_workers();
    if (n_workers <= 0) return 0;
    P.threads = (pthread_t *)calloc((size_t)n_workers, sizeof(pthread_t));
    P.spawn_gen = atomic_load(&P.gen);
    if (!P.threads) return -1;
    for (int i = 0; i < n_workers; i++) {
        if (pthread_create(&P.threads[i], NULL, worker_main, (void *)(intptr_t)(i + 1))) {
            P.n_workers = i;
            return -1;
        }
        P.n_workers = i + 1;
    }
    return 0;
}

void kv_pool_run(kv_task_fn fn, void *ctx, int64_t n_tasks, int n_threads) {
    if (n_tasks <= 0) return;
    if (n_threads > n_tasks) n_threads = (int)n_tasks;
    if (n_threads <= 1) {
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    pthread_once(&atfork_once, install_atfork);
    pthread_mutex_lock(&P.job_lock);
    /* the pool is sized to the call: every worker takes part in every job */
    if (resize(n_threads - 1) || P.n_workers == 0) {
        pthread_mutex_unlock(&P.job_lock);
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    P.fn = fn;
    P.ctx = ctx;
    P.n_tasks = n_tasks;
    atomic_store_explicit(&P.next, 0, memory_order_relaxed);
    atomic_store_explicit(&P.pending, P.n_workers, memory_order_relaxed);
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_release);
    pthread_cond_broadcast(&P.cv_work);
    pthread_mutex_unlock(&P.mu);
    run_tasks(0);
    int i = 0;
    while (atomic_load_explicit(&P.pending, memory_order_acquire) != 0 && i < SPIN_ITERS) {
        CPU_RELAX();
        i++;
    }
    if (atomic_load_explicit(&P.pending, memory_order_acquire) != 0) {
        pthread_mutex_lock(&P.mu);
        while (atomic_load_explicit(&P.pending, memory_order_acquire) != 0) pthread_cond_wait(&P.cv_done, &P.mu);
        pthread_mutex_unlock(&P.mu);
    }
    pthread_mutex_unlock(&P.job_lock);
}
