# cmake/instances.cmake — kernel instantiations generated from a table, a few to a .cu.
#
# gmoe_generate_instances(<out_var> TABLE <file> MACRO <name> INCLUDE <header>)
#   Reads the lines `<name>(<file stem>, <arguments>)` of TABLE (other lines are comments or
#   blank) and writes, for each file stem, <build>/instances/<file stem>.cu:
#       #include "<header>"
#       <name>_INSTANTIATE(<arguments>)      one line for each table line of that stem
#   Lines that share a stem share a translation unit: the CUTLASS headers are parsed, and the
#   templates common to the instantiations instantiated, once for all of them, which is most of an
#   instantiation's compile time (docs/decisions.md). A few per stem keep the build parallel and a
#   change's rebuild small; adding an instantiation stays one line of the table. A file is
#   rewritten only when its text changes; editing the table re-runs the configure step.
#   <out_var> receives the generated sources.
function(gmoe_generate_instances out_var)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TABLE;MACRO;INCLUDE" "")
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${arg_TABLE}")
  file(RELATIVE_PATH table "${PROJECT_SOURCE_DIR}" "${arg_TABLE}")
  file(STRINGS "${arg_TABLE}" lines REGEX "^${arg_MACRO}\\(")
  set(stems "")
  set(seen "")
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "^${arg_MACRO}\\(([A-Za-z0-9_]+), *(.+)\\)$")
      message(FATAL_ERROR "${table}: not a line of the table: ${line}")
    endif()
    set(stem "${CMAKE_MATCH_1}")
    set(arguments "${CMAKE_MATCH_2}")
    string(REPLACE " " "" key "${arguments}")
    if(key IN_LIST seen)
      message(FATAL_ERROR "${table}: ${arguments} twice")
    endif()
    list(APPEND seen "${key}")
    if(NOT stem IN_LIST stems)
      list(APPEND stems "${stem}")
      set(body_${stem} "")
    endif()
    string(APPEND body_${stem} "${arg_MACRO}_INSTANTIATE(${arguments})\n")
  endforeach()
  set(sources "")
  foreach(stem IN LISTS stems)
    set(source "${PROJECT_BINARY_DIR}/instances/${stem}.cu")
    file(CONFIGURE OUTPUT "${source}" CONTENT
      "// ${stem}.cu — generated from ${table} (cmake/instances.cmake): edit the table, not this file.\n#include \"${arg_INCLUDE}\"\n${body_${stem}}")
    list(APPEND sources "${source}")
  endforeach()
  set(${out_var} ${sources} PARENT_SCOPE)
endfunction()
