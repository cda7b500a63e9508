// What the AMX kernels share: asking Linux for AMX's register state, the tile configuration record, and the
// all-16 x 64-byte configuration AMX-BF16 uses. Included by int8_linear_cpu.cpp and prefill_attention_cpu.cpp.
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace inferd {

// Linux hands a process AMX's register state only when asked, once (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction kills the process.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// not _tile_loadconfig: GCC 12's declares an 8-byte operand, so the compiler may drop the stores of the rest
inline void load_tile_config(const TileConfig& c) { asm volatile("ldtilecfg %0" ::"m"(c)); }

// Eight tiles of 16 rows x 64 bytes: bf16 A (16 x 32), B (16 pairs x 16 x 2) and float32 C (16 x 16) tiles alike.
inline void configure_full_tiles() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) c.rows[i] = 16, c.colsb[i] = 64;
  load_tile_config(c);
}

}  // namespace inferd
#endif
