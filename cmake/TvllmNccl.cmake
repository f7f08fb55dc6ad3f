# NCCL, optional: lesson 17's all-reduce between GPUs. Nothing is vendored or downloaded; it is looked for in
#   1. -DTVLLM_NCCL_ROOT=<dir> (or the environment variable of that name): <dir>/include/nccl.h, <dir>/lib*/libnccl*
#   2. the CUDA toolkit (recent toolkits ship NCCL: <toolkit>/include/nccl.h, <toolkit>/lib or lib64)
#   3. the system (Debian's libnccl-dev: /usr/include, /usr/lib/x86_64-linux-gnu)
#   4. the python wheel nvidia-nccl-cu12/cu13 (pip, or what PyTorch brought): nvidia/nccl/{include,lib} of
#      `python3 -c "import nvidia.nccl"`. Some wheels ship libnccl.so.2 without nccl.h: then point
#      TVLLM_NCCL_ROOT (or CPATH) at a header of the same major version.
# Result: the imported target tvllm::nccl and TVLLM_HAVE_NCCL (ON/OFF). Without NCCL everything else builds,
# lesson 17's NCCL code is left out and its GPU tests report themselves skipped.
# -DTVLLM_WITH_NCCL=OFF builds as if there were none (how the NCCL-less build is tested on a machine that has it).
option(TVLLM_WITH_NCCL "Look for NCCL (lesson 17's all-reduce between GPUs)" ON)
set(TVLLM_NCCL_ROOT "$ENV{TVLLM_NCCL_ROOT}" CACHE PATH "Where NCCL lives (include/nccl.h, lib/libnccl.so*)")
if(NOT TVLLM_WITH_NCCL)
  set(TVLLM_HAVE_NCCL OFF)
  message(STATUS "NCCL: not looked for (TVLLM_WITH_NCCL=OFF): lesson 17 builds without it")
  return()
endif()

set(_tvllm_nccl_hints "")
if(TVLLM_NCCL_ROOT)
  list(APPEND _tvllm_nccl_hints ${TVLLM_NCCL_ROOT})
endif()
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _tvllm_nccl_hints ${CUDAToolkit_LIBRARY_ROOT})
endif()
if(CUDAToolkit_INCLUDE_DIRS)
  foreach(_d IN LISTS CUDAToolkit_INCLUDE_DIRS)
    get_filename_component(_up ${_d} DIRECTORY)
    list(APPEND _tvllm_nccl_hints ${_up})
  endforeach()
endif()
find_package(Python3 QUIET COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  execute_process(COMMAND ${Python3_EXECUTABLE} -c "import nvidia.nccl as n; print(n.__path__[0])"
                  OUTPUT_VARIABLE _tvllm_nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
                  RESULT_VARIABLE _tvllm_nccl_wheel_rc TIMEOUT 20)
  if(_tvllm_nccl_wheel_rc EQUAL 0 AND IS_DIRECTORY "${_tvllm_nccl_wheel}")
    list(APPEND _tvllm_nccl_hints ${_tvllm_nccl_wheel})
  endif()
endif()

find_path(TVLLM_NCCL_INCLUDE_DIR nccl.h HINTS ${_tvllm_nccl_hints} PATH_SUFFIXES include)
# libnccl.so, or the wheel's libnccl.so.2 (a wheel has no unversioned link).
find_library(TVLLM_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_tvllm_nccl_hints}
             PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu)

if(TVLLM_NCCL_INCLUDE_DIR AND TVLLM_NCCL_LIBRARY)
  set(TVLLM_HAVE_NCCL ON)
  file(STRINGS ${TVLLM_NCCL_INCLUDE_DIR}/nccl.h _v REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*NCCL_MINOR ([0-9]+).*NCCL_PATCH ([0-9]+).*" "\\1.\\2.\\3"
         _tvllm_nccl_version "${_v}")
  add_library(tvllm::nccl UNKNOWN IMPORTED)
  set_target_properties(tvllm::nccl PROPERTIES IMPORTED_LOCATION ${TVLLM_NCCL_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${TVLLM_NCCL_INCLUDE_DIR})
  message(STATUS "NCCL ${_tvllm_nccl_version}: ${TVLLM_NCCL_LIBRARY} (header in ${TVLLM_NCCL_INCLUDE_DIR})")
else()
  set(TVLLM_HAVE_NCCL OFF)
  if(TVLLM_NCCL_LIBRARY AND NOT TVLLM_NCCL_INCLUDE_DIR)
    message(STATUS "NCCL: found ${TVLLM_NCCL_LIBRARY} but no nccl.h (a wheel without headers?): "
                   "-DTVLLM_NCCL_ROOT=<dir with include/nccl.h>")
  endif()
  message(STATUS "NCCL not found: lesson 17 builds without its NCCL all-reduce (its GPU tests skip). "
                 "Install libnccl-dev, or -DTVLLM_NCCL_ROOT=<dir>")
endif()
