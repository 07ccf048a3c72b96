// Host probe of the generated ABI header: prints "<struct> <field> <bytes>" for every sizeof/offsetof entry of
// AMK_LAYOUT_ENTRIES. tests/vm/test_layout.py compiles it with g++ and compares the output with vm.abi.layout_table().
#include <cstdio>
#include "amk_abi.h"

int main() {
#define AMK_PRINT_ROW(S, F, V) std::printf("%s %s %lld\n", #S, #F, (long long)(V));
  AMK_LAYOUT_ENTRIES(AMK_PRINT_ROW)
#undef AMK_PRINT_ROW
  return 0;
}
