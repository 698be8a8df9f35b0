# cmake/fuzz.cmake — hostile input: two libFuzzer targets and bounded fuzz runs as tests (the
# GoogleTest suite of named defects, gmoe_tests_hostile, is the top-level CMakeLists.txt's).
#
# Include from the top-level CMakeLists.txt after enable_testing():   include(cmake/fuzz.cmake)
#
# libFuzzer needs clang, while the project may be compiled with g++; so this finds a clang++ on
# its own, checks that it links -fsanitize=fuzzer,address, and compiles the few sources each target
# needs directly with it (a custom command: no second toolchain in the project). Without such a
# clang++ it says so and adds no fuzz target, so builds on machines without clang keep working.
#
#   target gmoe_fuzz_safetensors      the safetensors parser (built with ALL when clang is usable)
#   target gmoe_fuzz_expert_layout    checkpoint open, expert-layout detection and conversion
#   test   checkpoint_fuzz            each runs its target for GMOE_FUZZ_SECONDS (default 20) on a
#   test   layout_fuzz                copy-on-write corpus in the build tree, seeded from the corpus
#                                     in tests/fuzz; any crash, sanitizer report, leak or slow
#                                     input (-timeout) fails the test

set(GMOE_FUZZ_SECONDS 20 CACHE STRING "Seconds each fuzz test (checkpoint_fuzz, layout_fuzz) runs")
find_program(GMOE_FUZZ_CLANGXX NAMES clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15 clang++-14)

if(NOT GMOE_FUZZ_CLANGXX)
  message(STATUS "gmoe: no clang++ found: fuzz targets skipped")
  return()
endif()

set(_gmoe_fuzz_probe_dir "${CMAKE_BINARY_DIR}/fuzz_probe")
file(WRITE "${_gmoe_fuzz_probe_dir}/probe.cpp"
  "#include <cstddef>\n#include <cstdint>\n"
  "extern \"C\" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n")
execute_process(
  COMMAND "${GMOE_FUZZ_CLANGXX}" -fsanitize=fuzzer,address probe.cpp -o probe
  WORKING_DIRECTORY "${_gmoe_fuzz_probe_dir}"
  RESULT_VARIABLE _gmoe_fuzz_probe_rc OUTPUT_QUIET ERROR_QUIET)
if(NOT _gmoe_fuzz_probe_rc EQUAL 0)
  message(STATUS "gmoe: ${GMOE_FUZZ_CLANGXX} cannot link -fsanitize=fuzzer: fuzz targets skipped")
  return()
endif()
message(STATUS "gmoe: fuzz targets with ${GMOE_FUZZ_CLANGXX}")

get_filename_component(_gmoe_src "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
set(_gmoe_fuzz_includes -I "${_gmoe_src}/include" -I "${_gmoe_src}/src")
if(EXISTS "${_gmoe_src}/.deps/bundle/include")  # headers bundled for machines without packages
  list(APPEND _gmoe_fuzz_includes -I "${_gmoe_src}/.deps/bundle/include")
endif()
file(GLOB _gmoe_fuzz_headers "${_gmoe_src}/include/gmoe/*.h" "${_gmoe_src}/src/checkpoint/*.h"
  "${_gmoe_src}/src/common/*.h")
# In its own folder: a file named like the target would make Make see a circular dependency.
file(MAKE_DIRECTORY "${CMAKE_BINARY_DIR}/fuzz")

# gmoe_fuzz_target(NAME TEST CORPUS MAX_LEN SOURCES...): the target, and its bounded run as TEST.
function(gmoe_fuzz_target name test corpus max_len)
  set(sources "${_gmoe_src}/tests/fuzz/${name}.cpp")
  foreach(s ${ARGN})
    list(APPEND sources "${_gmoe_src}/${s}")
  endforeach()
  set(bin "${CMAKE_BINARY_DIR}/fuzz/gmoe_${name}")
  add_custom_command(
    OUTPUT "${bin}"
    COMMAND "${GMOE_FUZZ_CLANGXX}" -std=c++17 -g -O1
            -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
            ${_gmoe_fuzz_includes} ${sources} -o "${bin}"
    DEPENDS ${sources} ${_gmoe_fuzz_headers}
    COMMENT "Building libFuzzer target gmoe_${name} with ${GMOE_FUZZ_CLANGXX}"
    VERBATIM)
  add_custom_target(gmoe_${name} ALL DEPENDS "${bin}")
  set(work "${CMAKE_BINARY_DIR}/fuzz_corpus/${name}")
  file(MAKE_DIRECTORY "${work}")
  # -timeout: an input that takes seconds is a finding (unbounded work from a small file).
  add_test(NAME ${test}
    COMMAND "${bin}" -max_total_time=${GMOE_FUZZ_SECONDS} -rss_limit_mb=2048 -timeout=10
            -max_len=${max_len} -print_final_stats=1 -dict=${_gmoe_src}/tests/fuzz/safetensors.dict
            "${work}" "${_gmoe_src}/tests/fuzz/${corpus}")
  set_tests_properties(${test} PROPERTIES TIMEOUT 300 LABELS "checkpoint;fuzz")
endfunction()

gmoe_fuzz_target(fuzz_safetensors checkpoint_fuzz corpus 1048576
  src/checkpoint/safetensors.cpp src/common/dtype.cpp src/common/tensor.cpp)
gmoe_fuzz_target(fuzz_expert_layout layout_fuzz corpus_layout 65536
  src/checkpoint/safetensors.cpp src/checkpoint/checkpoint.cpp src/checkpoint/expert_layout.cpp
  src/checkpoint/conventions.cpp src/common/dtype.cpp src/common/tensor.cpp)
