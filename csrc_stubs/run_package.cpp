// Runs an AOTInductor package in a process without Python: the deployment the stubs are for.
//
//   run_package STUBS.so PACKAGE.pt2 INPUT.bin ROWS COLS OUTPUT.bin
//
// Loads the stubs (so that the package's calls of torch.ops.tritonblas.* find a kernel), then
// the package, and runs it on one float32 CPU tensor of ROWS x COLS read from INPUT.bin (raw,
// row-major); the first output goes to OUTPUT.bin the same way. tests/test_export.py builds
// it (python -m tritonblas_ops.stubs build-runner) and checks what it computes.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <dlfcn.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 7) {
    std::cerr << "usage: " << argv[0] << " STUBS.so PACKAGE.pt2 INPUT.bin ROWS COLS OUTPUT.bin\n";
    return 2;
  }
  // Registers torch.ops.tritonblas.* with the dispatcher, as it loads.
  if (dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::cerr << "cannot load the stubs: " << dlerror() << "\n";
    return 1;
  }
  const int64_t rows = std::atoll(argv[4]), cols = std::atoll(argv[5]);
  at::Tensor x = at::empty({rows, cols}, at::kFloat);
  std::ifstream input(argv[3], std::ios::binary);
  input.read(reinterpret_cast<char*>(x.data_ptr<float>()), x.nbytes());
  if (!input) {
    std::cerr << "cannot read " << rows * cols << " floats from " << argv[3] << "\n";
    return 1;
  }

  torch::inductor::AOTIModelPackageLoader loader(argv[2]);
  std::vector<at::Tensor> outputs = loader.run({x});
  at::Tensor out = outputs.at(0).contiguous();
  std::ofstream output(argv[6], std::ios::binary);
  output.write(reinterpret_cast<const char*>(out.data_ptr<float>()), out.nbytes());
  std::cout << "output shape " << out.sizes() << "\n";
  return output ? 0 : 1;
}
