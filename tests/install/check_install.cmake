# tests/install/check_install.cmake — installs the built gmoe into a temporary prefix, then
# configures, builds and runs tests/install/consumer against it: the installable CMake package
# (find_package(gmoe) -> gmoe::gmoe, with its link dependencies) works for a user.
#   cmake -DGMOE_BUILD_DIR=... -DGMOE_SOURCE_DIR=... -P check_install.cmake
# The consumer is built as the library was (compiler, build type, flags): a library compiled with
# -fsanitize=address,undefined (the debug preset) links only into code built the same way.
set(consumer_flags "")
foreach(var CMAKE_CXX_COMPILER CMAKE_BUILD_TYPE CMAKE_CXX_FLAGS)
  file(STRINGS "${GMOE_BUILD_DIR}/CMakeCache.txt" line REGEX "^${var}:[A-Z]+=")
  if(line)
    string(REGEX REPLACE "^${var}:[A-Z]+=" "" value "${line}")
    list(APPEND consumer_flags "-D${var}=${value}")
  endif()
endforeach()
set(prefix "${GMOE_BUILD_DIR}/install_check/prefix")
set(consumer_build "${GMOE_BUILD_DIR}/install_check/consumer")
file(REMOVE_RECURSE "${GMOE_BUILD_DIR}/install_check")
foreach(step
    "${CMAKE_COMMAND};--install;${GMOE_BUILD_DIR};--prefix;${prefix}"
    "${CMAKE_COMMAND};-S;${GMOE_SOURCE_DIR}/tests/install/consumer;-B;${consumer_build};-DCMAKE_PREFIX_PATH=${prefix};${consumer_flags}"
    "${CMAKE_COMMAND};--build;${consumer_build}"
    "${consumer_build}/c")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install check failed at: ${step}\n${out}\n${err}")
  endif()
endforeach()
message(STATUS "install check: the installed package builds and runs a consumer")
