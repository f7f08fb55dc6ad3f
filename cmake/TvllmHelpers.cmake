# Helpers that keep every lesson's CMakeLists.txt a few lines long.

# tvllm_add_lesson(NUMBER 04 NAME rmsnorm SOURCES rmsnorm_cpu.cpp rmsnorm.cu LIBS tvllm_l03
#                  [MAIN main.cpp] [COURSE_ARGS --kernel v2])
# Builds:
#   tvllm_l04                  the stage's library (its folder is the include directory)
#   bin/lesson04_rmsnorm       the lesson executable (from MAIN, default main.cpp)
# and registers three runs of the executable on the bundled model:
#   course.lesson04_rmsnorm      --device auto   labels course;lesson04   (the learner's run: GPU if present,
#                                                                          else the CPU path with a notice)
#   lesson04_rmsnorm.cpu         --device cpu    labels lesson04;cpu
#   lesson04_rmsnorm.gpu         --device cuda   labels lesson04;gpu      (exits 77 without a GPU: CTest
#                                                                          reports it as skipped)
# FILLS_GPU_MEMORY: the executable sizes something from the GPU's free memory (an engine over a paged KV pool
# with the default 0.9 of it); its two runs that may take the GPU (course, .gpu) then hold the CTest resource
# lock gpu_memory, as tvllm_add_test explains.
function(tvllm_add_lesson)
  cmake_parse_arguments(L "FILLS_GPU_MEMORY" "NUMBER;NAME;MAIN" "SOURCES;LIBS;COURSE_ARGS" ${ARGN})
  set(lib tvllm_l${L_NUMBER})
  set(exe lesson${L_NUMBER}_${L_NAME})
  if(L_SOURCES)
    add_library(${lib} STATIC ${L_SOURCES})
    target_include_directories(${lib} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
    target_link_libraries(${lib} PUBLIC tvllm_common ${L_LIBS})
    set_target_properties(${lib} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF POSITION_INDEPENDENT_CODE ON)
  else()
    add_library(${lib} INTERFACE)
    target_include_directories(${lib} INTERFACE ${CMAKE_CURRENT_SOURCE_DIR})
    target_link_libraries(${lib} INTERFACE tvllm_common ${L_LIBS})
  endif()
  if(NOT L_MAIN)
    set(L_MAIN main.cpp)
  endif()
  add_executable(${exe} ${L_MAIN})
  target_link_libraries(${exe} PRIVATE ${lib})
  target_compile_definitions(${exe} PRIVATE TVLLM_LESSON_NAME="${exe}")
  set_property(GLOBAL APPEND PROPERTY TVLLM_LESSON_EXES ${exe})
  add_test(NAME course.${exe} COMMAND ${exe} --device auto ${L_COURSE_ARGS})
  set_tests_properties(course.${exe} PROPERTIES LABELS "course;lesson${L_NUMBER}")
  add_test(NAME ${exe}.cpu COMMAND ${exe} --device cpu ${L_COURSE_ARGS})
  set_tests_properties(${exe}.cpu PROPERTIES LABELS "lesson${L_NUMBER};cpu")
  add_test(NAME ${exe}.gpu COMMAND ${exe} --device cuda ${L_COURSE_ARGS})
  set_tests_properties(${exe}.gpu PROPERTIES LABELS "lesson${L_NUMBER};gpu" SKIP_RETURN_CODE 77)
  if(L_FILLS_GPU_MEMORY)
    set_tests_properties(course.${exe} ${exe}.gpu PROPERTIES RESOURCE_LOCK gpu_memory)
  endif()
endfunction()

# tvllm_add_test(NAME test_04_rmsnorm LABELS "lesson04;cpu" SOURCES ... LIBS ...
#                [FILLS_GPU_MEMORY regex...] [MEASURES_GPU regex...])
# One GoogleTest executable; every test in it gets the labels. Tests that call GTEST_SKIP() (GPU tests
# on a machine without a GPU) are reported by CTest as skipped, never as passed.
#
# Sharing one GPU. CTest runs each test as its own process, so `ctest -j 4` puts four of them on the GPU at
# once. Most GPU tests allocate a few MiB to a few hundred and time nothing: they can share it. Two kinds cannot:
#   FILLS_GPU_MEMORY  tests that size something from the GPU's FREE memory (an engine over a paged KV pool
#                     with num_blocks 0 takes 0.9 of it). Two at once would race for the same memory, so they
#                     hold the resource lock gpu_memory: at most one runs at a time (ordinary tests beside it
#                     live in the tenth it leaves free).
#   MEASURES_GPU      tests that need the GPU to themselves: free memory read before and after, a bandwidth or
#                     time with a plausibility bound, an out-of-memory expected on purpose. They RUN_SERIAL:
#                     CTest starts them only when nothing else runs, and nothing else while they do.
# Each list holds regular expressions matched against a whole test name (Suite.Name, as GoogleTest prints
# it): "Suite.*" takes a whole suite, ".*" the whole program. A pattern that matches no test is a stale
# name (a test renamed): CTest warns about it whenever it reads the tests.
function(tvllm_add_test)
  cmake_parse_arguments(T "" "NAME" "LABELS;SOURCES;LIBS;FILLS_GPU_MEMORY;MEASURES_GPU" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} tvllm_testing GTest::gtest GTest::gtest_main)
  gtest_discover_tests(${T_NAME} DISCOVERY_TIMEOUT 60 TEST_LIST ${T_NAME}_TESTS)
  # Properties are set by a script CTest runs after it has read the discovered tests: passing a list
  # such as "lesson04;gpu" through gtest_discover_tests(PROPERTIES ...) splits it on CMake < 3.28.
  # The patterns go in as bracket arguments ([==[...]==]), read verbatim: no backslash is eaten.
  set(script ${CMAKE_CURRENT_BINARY_DIR}/${T_NAME}_properties.cmake)
  file(WRITE ${script}
    "foreach(t IN LISTS ${T_NAME}_TESTS)\n"
    "  set_tests_properties(\"\${t}\" PROPERTIES LABELS \"${T_LABELS}\" SKIP_REGULAR_EXPRESSION \"\\\\[  SKIPPED\")\n"
    "endforeach()\n"
    "set(fills_patterns [==[${T_FILLS_GPU_MEMORY}]==])\n"
    "set(fills_properties RESOURCE_LOCK gpu_memory)\n"
    "set(measures_patterns [==[${T_MEASURES_GPU}]==])\n"
    "set(measures_properties RUN_SERIAL TRUE)\n"
    "foreach(kind IN ITEMS fills measures)\n"
    "  foreach(pattern IN LISTS \${kind}_patterns)\n"
    "    set(matched FALSE)\n"
    "    foreach(t IN LISTS ${T_NAME}_TESTS)\n"
    "      if(t MATCHES \"^(\${pattern})\$\")\n"
    "        set_tests_properties(\"\${t}\" PROPERTIES \${\${kind}_properties})\n"
    "        set(matched TRUE)\n"
    "      endif()\n"
    "    endforeach()\n"
    "    # (no tests at all: the program is not built yet, and CTest lists ${T_NAME}_NOT_BUILT)\n"
    "    if(NOT matched AND ${T_NAME}_TESTS)\n"
    "      message(WARNING \"${T_NAME}: '\${pattern}' (tests/CMakeLists.txt) matches none of its tests\")\n"
    "    endif()\n"
    "  endforeach()\n"
    "endforeach()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${script})
endfunction()
