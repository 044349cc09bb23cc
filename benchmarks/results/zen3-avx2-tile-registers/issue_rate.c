#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#include <stdint.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  long N=200000000;
  double t=now();
  __asm__ volatile(
    "vpxor %%ymm0,%%ymm0,%%ymm0\n vpxor %%ymm1,%%ymm1,%%ymm1\n"
    "mov %0, %%rcx\n"
    "1:\n"
    "vpmaddubsw %%ymm0,%%ymm1,%%ymm2\n vpmaddubsw %%ymm0,%%ymm1,%%ymm3\n vpmaddubsw %%ymm0,%%ymm1,%%ymm4\n vpmaddubsw %%ymm0,%%ymm1,%%ymm5\n"
    "vpmaddubsw %%ymm0,%%ymm1,%%ymm6\n vpmaddubsw %%ymm0,%%ymm1,%%ymm7\n vpmaddubsw %%ymm0,%%ymm1,%%ymm8\n vpmaddubsw %%ymm0,%%ymm1,%%ymm9\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(N/8) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9");
  double dt=now()-t; printf("vpmaddubsw: %.2f G/s\n", N/dt/1e9);
  t=now();
  __asm__ volatile(
    "mov %0, %%rcx\n"
    "1:\n"
    "vpmaddubsw %%ymm0,%%ymm1,%%ymm2\n vpaddw %%ymm2,%%ymm10,%%ymm10\n vpmaddubsw %%ymm0,%%ymm1,%%ymm3\n vpaddw %%ymm3,%%ymm11,%%ymm11\n"
    "vpmaddubsw %%ymm0,%%ymm1,%%ymm4\n vpaddw %%ymm4,%%ymm12,%%ymm12\n vpmaddubsw %%ymm0,%%ymm1,%%ymm5\n vpaddw %%ymm5,%%ymm13,%%ymm13\n"
    "vpmaddubsw %%ymm0,%%ymm1,%%ymm6\n vpaddw %%ymm6,%%ymm14,%%ymm14\n vpmaddubsw %%ymm0,%%ymm1,%%ymm7\n vpaddw %%ymm7,%%ymm15,%%ymm15\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(N/6) : "rcx","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15");
  dt=now()-t; printf("vpmaddubsw+vpaddw: %.2f G pairs/s\n", N/dt/1e9);
  static uint8_t buf[4096] __attribute__((aligned(64)));
  t=now();
  __asm__ volatile(
    "mov %0, %%rcx\n"
    "1:\n"
    "vmovdqu (%1),%%ymm0\n vmovdqu 32(%1),%%ymm1\n vpbroadcastd 64(%1),%%ymm2\n vpbroadcastd 68(%1),%%ymm3\n vpbroadcastd 72(%1),%%ymm4\n"
    "vpmaddubsw %%ymm2,%%ymm0,%%ymm5\n vpaddw %%ymm5,%%ymm10,%%ymm10\n vpmaddubsw %%ymm2,%%ymm1,%%ymm6\n vpaddw %%ymm6,%%ymm11,%%ymm11\n"
    "vpmaddubsw %%ymm3,%%ymm0,%%ymm7\n vpaddw %%ymm7,%%ymm12,%%ymm12\n vpmaddubsw %%ymm3,%%ymm1,%%ymm8\n vpaddw %%ymm8,%%ymm13,%%ymm13\n"
    "vpmaddubsw %%ymm4,%%ymm0,%%ymm9\n vpaddw %%ymm9,%%ymm14,%%ymm14\n vpmaddubsw %%ymm4,%%ymm1,%%ymm2\n vpaddw %%ymm2,%%ymm15,%%ymm15\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(N/6), "r"(buf) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15");
  dt=now()-t; printf("quad 3x2 (2 loads + 3 bcast): %.2f G maddubs/s\n", N/dt/1e9);
  t=now();
  __asm__ volatile(
    "mov %0, %%rcx\n"
    "1:\n"
    "vpbroadcastd 64(%1),%%ymm2\n vpbroadcastd 68(%1),%%ymm3\n vpbroadcastd 72(%1),%%ymm4\n"
    "vmovdqu (%1),%%ymm0\n vpmaddubsw %%ymm2,%%ymm0,%%ymm5\n vpaddw %%ymm5,%%ymm10,%%ymm10\n vmovdqu 32(%1),%%ymm1\n vpmaddubsw %%ymm2,%%ymm1,%%ymm6\n vpaddw %%ymm6,%%ymm11,%%ymm11\n"
    "vmovdqu (%1),%%ymm0\n vpmaddubsw %%ymm3,%%ymm0,%%ymm7\n vpaddw %%ymm7,%%ymm12,%%ymm12\n vmovdqu 32(%1),%%ymm1\n vpmaddubsw %%ymm3,%%ymm1,%%ymm8\n vpaddw %%ymm8,%%ymm13,%%ymm13\n"
    "vmovdqu (%1),%%ymm0\n vpmaddubsw %%ymm4,%%ymm0,%%ymm9\n vpaddw %%ymm9,%%ymm14,%%ymm14\n vmovdqu 32(%1),%%ymm1\n vpmaddubsw %%ymm4,%%ymm1,%%ymm2\n vpaddw %%ymm2,%%ymm15,%%ymm15\n"
    "dec %%rcx\n jnz 1b\n" :: "r"(N/6), "r"(buf) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15");
  dt=now()-t; printf("quad 3x2 (6 loads + 3 bcast, as GCC): %.2f G maddubs/s\n", N/dt/1e9);
  return 0;
}
