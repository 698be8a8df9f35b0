# tests/run_suite.cmake — runs one GoogleTest suite for CTest and prints its counts.
#
#   cmake -DSUITE=path/to/binary -DNAME=name [-DFILTER=--gtest_filter=...] -P tests/run_suite.cmake
#
# Prints the suite's output and one line "gmoe-suite NAME: P passed, S skipped, F failed" (scripts/test.sh
# collects these lines into the log); with FILTER (the sanitizer subset, CMakeLists.txt) that line
# names the filter, so that a log says which tests a count covers. When every test of a suite
# skipped (the CUDA suite without a GPU) it also prints "gmoe-suite NAME: every test skipped", which
# the suite's SKIP_REGULAR_EXPRESSION turns into a CTest skip: a suite that ran nothing must not
# read as passed.
execute_process(COMMAND "${SUITE}" --gtest_brief=1 ${FILTER} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
foreach(kind PASSED SKIPPED FAILED)
  set(n_${kind} 0)
  if(out MATCHES "\n\\[  ${kind} *\\] ([0-9]+) test")
    set(n_${kind} ${CMAKE_MATCH_1})
  endif()
endforeach()
set(subset "")
if(FILTER)
  set(subset " (sanitizer subset: ${FILTER})")
endif()
message("gmoe-suite ${NAME}: ${n_PASSED} passed, ${n_SKIPPED} skipped, ${n_FAILED} failed${subset}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "gmoe-suite ${NAME}: exit status ${rc}")
endif()
if(n_PASSED EQUAL 0 AND n_SKIPPED GREATER 0)
  message("gmoe-suite ${NAME}: every test skipped")
endif()
