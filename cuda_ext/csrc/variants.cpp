// Launch-configuration variants (kernels.h): process-wide, default 0.
#include "kernels.h"

namespace graphopt {

static int g_variants[VAR_COUNT] = {0, 0, 0};
int variant(int kernel) { return (kernel >= 0 && kernel < VAR_COUNT) ? g_variants[kernel] : 0; }

}  // namespace graphopt

// Set a kernel family's launch variant (for bench_kernels.py --variants, through ctypes);
// returns the previous value, or -1 for an unknown family / negative variant.
extern "C" int graphopt_set_variant(int kernel, int v) {
  if (kernel < 0 || kernel >= graphopt::VAR_COUNT || v < 0) return -1;
  const int old = graphopt::g_variants[kernel];
  graphopt::g_variants[kernel] = v;
  return old;
}
