/* The CPU's float32 FMA ceiling, measured: every core (the affinity mask's count, or argv[1]
 * threads) runs 12 independent chains of vector FMAs on registers only, no memory traffic, for
 * ~argv[2] seconds (default 0.5). Prints "threads lanes GFLOP/s". No float32 code doing the same
 * arithmetic can run faster than this on the machine; bench/peer.py builds it with the system C
 * compiler (-O3 -march=native) and reports every implementation's GFLOP/s against it. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifndef VEC_BYTES
#if defined(__AVX512F__)
#define VEC_BYTES 64
#else
#define VEC_BYTES 32
#endif
#endif
typedef float vf __attribute__((vector_size(VEC_BYTES)));
#define LANES (VEC_BYTES / 4)
#define ACC 12
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static long iters;
static volatile float sink;
static volatile float seed_a = 0.999999f, seed_b = 1e-7f;
static void* worker(void* arg) {
  (void)arg;
  const vf a = (vf){} + seed_a, b = (vf){} + seed_b;  /* opaque to the compiler */
  vf x0 = a * 0.1f, x1 = a * 0.2f, x2 = a * 0.3f, x3 = a * 0.4f, x4 = a * 0.5f, x5 = a * 0.6f;
  vf x6 = a * 0.7f, x7 = a * 0.8f, x8 = a * 0.9f, x9 = a * 1.1f, x10 = a * 1.2f, x11 = a * 1.3f;
  for (long it = 0; it < iters; ++it) {  /* 12 independent chains: latency hidden, FMA-bound */
    x0 = x0 * a + b; x1 = x1 * a + b; x2 = x2 * a + b; x3 = x3 * a + b;
    x4 = x4 * a + b; x5 = x5 * a + b; x6 = x6 * a + b; x7 = x7 * a + b;
    x8 = x8 * a + b; x9 = x9 * a + b; x10 = x10 * a + b; x11 = x11 * a + b;
  }
  vf s = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7 + x8 + x9 + x10 + x11;
  float total = 0;
  for (int i = 0; i < LANES; ++i) total += s[i];
  sink = total;
  return NULL;
}

int main(int argc, char** argv) {
  cpu_set_t set; sched_getaffinity(0, sizeof set, &set);
  int threads = argc > 1 ? atoi(argv[1]) : CPU_COUNT(&set);
  double seconds = argc > 2 ? atof(argv[2]) : 0.5;
  iters = 1000000;
  for (;;) {  /* calibrate on one thread */
    double t0 = now(); worker(NULL); double dt = now() - t0;
    if (dt > 0.05) { iters = (long)(iters * seconds / dt); break; }
    iters *= 4;
  }
  pthread_t th[256];
  double t0 = now();
  for (int t = 0; t < threads; ++t) pthread_create(&th[t], NULL, worker, NULL);
  for (int t = 0; t < threads; ++t) pthread_join(th[t], NULL);
  double dt = now() - t0;
  printf("%d %d %.3f\n", threads, LANES, 2.0 * ACC * LANES * iters * threads / dt / 1e9);
  return 0;
}
