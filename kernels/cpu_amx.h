// AMX tile state for the CPU GEMV kernels (kernels/cpu_gemv.cpp, kernels/cpu_gemv_quantized.cpp),
// which include it; kernels/cpu_attention_build.py keys a library by its source and the headers
// of this folder it includes.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace ce_amx {

// The tile configuration _tile_loadconfig reads (palette 1: up to 8 tiles of 16 rows x 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands out the AMX register state only on request, once per process (per library: each
// kernel library asks for itself; a second grant is a no-op).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

}  // namespace ce_amx
