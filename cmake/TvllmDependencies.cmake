# Third-party dependencies. Each is taken from the system first (Debian: nlohmann-json3-dev,
# libcli11-dev, libgtest-dev; .ci/run installs them) and fetched with FetchContent only when missing.
include(FetchContent)

find_package(CUDAToolkit REQUIRED)   # CUDA::cudart, CUDA::cublas

find_package(nlohmann_json 3.10 QUIET)
if(NOT nlohmann_json_FOUND)
  message(STATUS "nlohmann_json not found on the system: fetching it")
  FetchContent_Declare(nlohmann_json
    URL https://github.com/nlohmann/json/releases/download/v3.11.3/json.tar.xz)
  FetchContent_MakeAvailable(nlohmann_json)
endif()

find_package(CLI11 2.0 QUIET)
if(NOT CLI11_FOUND)
  message(STATUS "CLI11 not found on the system: fetching it")
  FetchContent_Declare(cli11 GIT_REPOSITORY https://github.com/CLIUtils/CLI11.git GIT_TAG v2.4.2)
  FetchContent_MakeAvailable(cli11)
endif()

if(TVLLM_BUILD_TESTS)
  find_package(GTest QUIET)
  if(NOT GTest_FOUND)
    message(STATUS "GoogleTest not found on the system: fetching it")
    FetchContent_Declare(googletest
      URL https://github.com/google/googletest/archive/refs/tags/v1.14.0.tar.gz)
    set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
    FetchContent_MakeAvailable(googletest)
  endif()
  include(GoogleTest)
endif()
