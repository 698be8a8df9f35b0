# cmake/fuzz.cmake — the libFuzzer target of the safetensors parser, and a bounded fuzz run as a test.
#
# Include from the top-level CMakeLists.txt after enable_testing():   include(cmake/fuzz.cmake)
#
# libFuzzer needs clang, while the project may be compiled with g++; so this finds a clang++ on
# its own, checks that it links -fsanitize=fuzzer,address, and compiles the few sources the parser
# needs directly with it (a custom command: no second toolchain in the project). Without such a
# clang++ it says so and adds nothing, so builds on machines without clang keep working.
#
#   target gmoe_fuzz_safetensors   built with ALL when clang is usable
#   test   checkpoint_fuzz         runs it for GMOE_FUZZ_SECONDS (default 20) on a copy-on-write
#                                  corpus in the build tree, seeded from tests/fuzz/corpus; any
#                                  crash, sanitizer report or leak fails the test

set(GMOE_FUZZ_SECONDS 20 CACHE STRING "Seconds the checkpoint_fuzz test fuzzes the safetensors parser")
find_program(GMOE_FUZZ_CLANGXX NAMES clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15 clang++-14)

if(NOT GMOE_FUZZ_CLANGXX)
  message(STATUS "gmoe: no clang++ found: fuzz target gmoe_fuzz_safetensors skipped")
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
  message(STATUS "gmoe: ${GMOE_FUZZ_CLANGXX} cannot link -fsanitize=fuzzer: fuzz target skipped")
  return()
endif()
message(STATUS "gmoe: fuzz target gmoe_fuzz_safetensors with ${GMOE_FUZZ_CLANGXX}")

get_filename_component(_gmoe_src "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
# Only what the parser needs, so the fuzz build stays small and independent of the rest.
set(_gmoe_fuzz_sources
  "${_gmoe_src}/tests/fuzz/fuzz_safetensors.cpp"
  "${_gmoe_src}/src/checkpoint/safetensors.cpp"
  "${_gmoe_src}/src/common/dtype.cpp"
  "${_gmoe_src}/src/common/tensor.cpp")
set(_gmoe_fuzz_includes -I "${_gmoe_src}/include" -I "${_gmoe_src}/src")
if(EXISTS "${_gmoe_src}/.deps/bundle/include")  # headers bundled for machines without packages
  list(APPEND _gmoe_fuzz_includes -I "${_gmoe_src}/.deps/bundle/include")
endif()
file(GLOB _gmoe_fuzz_headers "${_gmoe_src}/include/gmoe/*.h" "${_gmoe_src}/src/checkpoint/*.h")
# In its own folder: a file named like the target would make Make see a circular dependency.
set(_gmoe_fuzz_bin "${CMAKE_BINARY_DIR}/fuzz/gmoe_fuzz_safetensors")
file(MAKE_DIRECTORY "${CMAKE_BINARY_DIR}/fuzz")

add_custom_command(
  OUTPUT "${_gmoe_fuzz_bin}"
  COMMAND "${GMOE_FUZZ_CLANGXX}" -std=c++17 -g -O1
          -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
          ${_gmoe_fuzz_includes} ${_gmoe_fuzz_sources} -o "${_gmoe_fuzz_bin}"
  DEPENDS ${_gmoe_fuzz_sources} ${_gmoe_fuzz_headers}
  COMMENT "Building libFuzzer target gmoe_fuzz_safetensors with ${GMOE_FUZZ_CLANGXX}"
  VERBATIM)
add_custom_target(gmoe_fuzz_safetensors ALL DEPENDS "${_gmoe_fuzz_bin}")

set(_gmoe_fuzz_corpus "${CMAKE_BINARY_DIR}/fuzz_corpus/safetensors")
file(MAKE_DIRECTORY "${_gmoe_fuzz_corpus}")
add_test(NAME checkpoint_fuzz
  COMMAND "${_gmoe_fuzz_bin}" -max_total_time=${GMOE_FUZZ_SECONDS} -rss_limit_mb=2048
          -dict=${_gmoe_src}/tests/fuzz/safetensors.dict
          "${_gmoe_fuzz_corpus}" "${_gmoe_src}/tests/fuzz/corpus")
set_tests_properties(checkpoint_fuzz PROPERTIES TIMEOUT 300 LABELS "checkpoint;fuzz")
