# cmake/instances.cmake — kernel instantiations generated from a table, one small .cu per line.
#
# gmoe_generate_instances(<out_var> TABLE <file> MACRO <name> INCLUDE <header>)
#   Reads the lines `<name>(<file stem>, <arguments>)` of TABLE (other lines are comments or
#   blank) and writes, for each, <build>/instances/<file stem>.cu:
#       #include "<header>"
#       <name>_INSTANTIATE(<arguments>)
#   so that every instantiation compiles once, in its own translation unit (builds parallelise,
#   an edit rebuilds only what it touches), and adding one is one line of the table. A file is
#   rewritten only when its text changes; editing the table re-runs the configure step.
#   <out_var> receives the generated sources.
function(gmoe_generate_instances out_var)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TABLE;MACRO;INCLUDE" "")
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${arg_TABLE}")
  file(RELATIVE_PATH table "${PROJECT_SOURCE_DIR}" "${arg_TABLE}")
  file(STRINGS "${arg_TABLE}" lines REGEX "^${arg_MACRO}\\(")
  set(sources "")
  set(stems "")
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "^${arg_MACRO}\\(([A-Za-z0-9_]+), *(.+)\\)$")
      message(FATAL_ERROR "${table}: not a line of the table: ${line}")
    endif()
    set(stem "${CMAKE_MATCH_1}")
    set(arguments "${CMAKE_MATCH_2}")
    if(stem IN_LIST stems)
      message(FATAL_ERROR "${table}: ${stem} twice")
    endif()
    list(APPEND stems "${stem}")
    set(source "${PROJECT_BINARY_DIR}/instances/${stem}.cu")
    file(CONFIGURE OUTPUT "${source}" CONTENT
      "// ${stem}.cu — generated from ${table} (cmake/instances.cmake): edit the table, not this file.\n#include \"${arg_INCLUDE}\"\n${arg_MACRO}_INSTANTIATE(${arguments})\n")
    list(APPEND sources "${source}")
  endforeach()
  set(${out_var} ${sources} PARENT_SCOPE)
endfunction()
