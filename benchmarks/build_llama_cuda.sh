#!/bin/bash
# Build llama.cpp's llama-imatrix and llama-perplexity with CUDA (sm_90) from the sources vendored in
# llama-cpp-python 0.3.36, on a machine without a GPU, for benchmarks/gpu_vs_llama_cpp.py; pack the result
# into OUT.tar.xz to carry to a GPU machine. Needs nvcc (CUDA 13), cuBLAS headers and libraries in the CUDA
# tree (e.g. from the nvidia-cublas wheel), cmake and ninja, and the CPU tools built by
# tests/llama_cpp_sources.py (their generic static llama libraries are reused).
#
#   benchmarks/build_llama_cuda.sh BUILD_DIR OUT.tar.xz [all]
#
# A full ggml-cuda build is ~2 h on 2 cores. Without "all" the template instances a batched F16 evaluation
# does not reach -- quantized matmul (mmq) and single-token attention (fattn-vec) -- are not compiled, nor the
# objects matching the extended regex GGUFKIT_CUDA_SKIP (e.g. 'fattn-tile-instance|fattn-mma-f16-instance' for
# runs with -fa off); each of their symbols becomes a stub that aborts with its name, so a run that needs one
# fails loudly instead of taking another path.
set -euo pipefail
B=$(realpath -m "$1"); OUT=$(realpath -m "$2"); ALL=${3:-}
SRC=$HOME/.cache/ggufkit/llama_cpp_python-0.3.36/vendor/llama.cpp
T=$HOME/.cache/ggufkit/llama_cpp_tools-0.3.36/build
CUDA=$(realpath "${CUDA_HOME:-/usr/local/cuda}")
mkdir -p "$CUDA/lib/stubs" "$B/pack"
# libcuda.so is the driver: link against an empty stand-in (the runs preload the real one)
[ -e "$CUDA/lib/stubs/libcuda.so" ] || { echo 'void ggufkit_stub(void){}' > "$B/stub.c";
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CUDA/lib/stubs/libcuda.so" "$B/stub.c"; }
cmake -S "$SRC" -B "$B/b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
cd "$B/b"
ninja -t commands ggml > "$B/ggml_cmds.txt"
if [ -n "$ALL" ]; then ninja ggml; else
  targets=$(ninja -t targets all | grep -o '^[^:]*\.cu\.o' | grep -v -E "mmq-instance|fattn-vec-instance${GGUFKIT_CUDA_SKIP:+|$GGUFKIT_CUDA_SKIP}")
  ninja $targets ggml/src/libggml-base.so ggml/src/libggml-cpu.so 2>/dev/null || ninja $targets bin/libggml-base.so bin/libggml-cpu.so
  link=$(grep -- '-soname,libggml-cuda.so' "$B/ggml_cmds.txt" | sed 's/&& :$//')
  kept=$(for p in $link; do case $p in *.cu.o) [ -e "$p" ] && echo -n "$p ";; *) echo -n "$p ";; esac; done)
  bash -c "$kept"
  nm -D --undefined-only bin/libggml-cuda.so.* | awk '{print $2}' | sed 's/@.*//' | sort -u > "$B/undef.txt"
  for l in bin/libggml-base.so "$CUDA"/lib/libcudart.so "$CUDA"/lib/libcublas.so "$CUDA"/lib/libcublasLt.so \
      "$(g++ -print-file-name=libstdc++.so.6)" /lib/x86_64-linux-gnu/libc.so.6 /lib/x86_64-linux-gnu/libm.so.6 \
      "$(gcc -print-file-name=libgcc_s.so.1)"; do nm -D --defined-only "$(realpath "$l")" | awk '{print $3}' | sed 's/@.*//'; done \
    | sort -u > "$B/def.txt"
  comm -23 "$B/undef.txt" "$B/def.txt" | grep -v -E '^$|^cu[A-Z]|^__gmon_start__|^_ITM_|^__cxa_finalize' > "$B/missing.txt" || true
  { echo '#include <stdio.h>'; echo '#include <stdlib.h>'
    while read -r s; do echo "void $s(void) { fputs(\"ggml-cuda: kernel instance $s was left out of this build\\n\", stderr); abort(); }"; done < "$B/missing.txt"; } > "$B/leftout.c"
  gcc -O1 -fPIC -c "$B/leftout.c" -o "$B/leftout.o"
  bash -c "$(echo "$kept" | sed "s# -o bin/libggml-cuda.so# $B/leftout.o -o bin/libggml-cuda.so#")"
  cmake -E cmake_symlink_library bin/libggml-cuda.so.0.25.3 bin/libggml-cuda.so.0 bin/libggml-cuda.so
  bash -c "$(grep -- '-soname,libggml.so' "$B/ggml_cmds.txt" | sed 's/&& :$//')"
  cmake -E cmake_symlink_library bin/libggml.so.0.25.3 bin/libggml.so.0 bin/libggml.so
fi
L="$T/common/libllama-common.a $T/common/libllama-common-base.a $T/vendor/cpp-httplib/libcpp-httplib.a $T/src/libllama.a"
G="-L$B/b/bin -lggml -lggml-base -ldl -lm -lpthread -Wl,-rpath,\$ORIGIN -Wl,--allow-shlib-undefined"
c++ -O3 "$T/tools/imatrix/CMakeFiles/llama-imatrix.dir/imatrix.cpp.o" -o "$B/pack/llama-imatrix" $L $G
c++ -O3 "$T/tools/perplexity/CMakeFiles/llama-perplexity.dir/main.cpp.o" -o "$B/pack/llama-perplexity" \
  "$T/tools/perplexity/libllama-perplexity-impl.a" $L $G
for f in libggml.so.0 libggml-base.so.0 libggml-cpu.so.0 libggml-cuda.so.0; do cp -L "bin/$f" "$B/pack/"; done
cp -L "$(gcc -print-file-name=libgomp.so.1)" "$B/pack/"
tar -C "$B/pack" -cf - . | xz -T0 -6 > "$OUT"
echo "wrote $OUT"
