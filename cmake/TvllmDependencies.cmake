# Third-party dependencies. Each one is looked for in this order:
#   1. already there: find_package() or pkg-config, on the system or under CMAKE_PREFIX_PATH (e.g. the
#      .deps/ folder tests/gpu_pass.sh uses on a machine without a package registry);
#   2. on Debian/Ubuntu, installed from this configure step: `apt-get install` as root, else
#      `sudo apt-get install` (sudo asks for your password on this terminal). -DTVLLM_INSTALL_DEPS=OFF
#      turns that off; without apt-get or sudo the configure says which packages to install;
#   3. downloaded with FetchContent (needs the network; stops with a message, never hangs).
# Adding a dependency is one tvllm_dependency() line at the end of this file.
include(FetchContent)

# The environment variable of the same name sets the default, for tools that configure trees of their own
# (tests/student/student.py's workspaces on a machine without a package registry).
set(_tvllm_install_default ON)
if(DEFINED ENV{TVLLM_INSTALL_DEPS})
  set(_tvllm_install_default $ENV{TVLLM_INSTALL_DEPS})
endif()
option(TVLLM_INSTALL_DEPS "Install missing Debian/Ubuntu packages from the configure step (apt-get, or sudo)"
       ${_tvllm_install_default})
set(TVLLM_FETCH_TIMEOUT 120 CACHE STRING "Seconds a FetchContent download may take before the configure stops")

find_package(CUDAToolkit REQUIRED)   # CUDA::cudart, CUDA::cublas, CUDA::cublasLt: the one prerequisite

# tvllm_dependency(<Name> DEBIAN <package> [VERSION <min>] [PKGCONFIG <module>] [URL <url> SHA256 <hash>])
# Declares a dependency: found with find_package(<Name> <min>), or with pkg-config as the imported target
# PkgConfig::<Name> when PKGCONFIG is given; <package> is the Debian package that provides it; URL is the
# source archive FetchContent builds when neither is possible.
set(_tvllm_deps "")
macro(tvllm_dependency name)
  cmake_parse_arguments(_tvllm_${name} "" "DEBIAN;VERSION;PKGCONFIG;URL;SHA256" "" ${ARGN})
  list(APPEND _tvllm_deps ${name})
endmacro()

# Looks for one dependency; sets <Name>_FOUND. A macro, so that the result is visible to the caller.
macro(_tvllm_find name)
  if(_tvllm_${name}_PKGCONFIG)
    find_package(PkgConfig QUIET)
    if(PkgConfig_FOUND)
      pkg_check_modules(${name} QUIET IMPORTED_TARGET GLOBAL ${_tvllm_${name}_PKGCONFIG})
    endif()
  else()
    find_package(${name} ${_tvllm_${name}_VERSION} QUIET)
  endif()
endmacro()

# Installs Debian packages with apt-get, through sudo when not root. Output is not captured: apt-get's
# progress and sudo's password prompt go straight to the terminal. Sets _tvllm_install_ok.
function(_tvllm_apt_install packages)
  set(_tvllm_install_ok FALSE PARENT_SCOPE)
  find_program(_tvllm_apt apt-get)
  find_program(_tvllm_dpkg dpkg)
  if(NOT _tvllm_apt OR NOT _tvllm_dpkg)
    message(STATUS "Missing packages: this is not a Debian/Ubuntu system (no apt-get), so they are not installed")
    return()
  endif()
  execute_process(COMMAND id -u OUTPUT_VARIABLE uid OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(uid STREQUAL "0")
    set(as_root env DEBIAN_FRONTEND=noninteractive)
  else()
    find_program(_tvllm_sudo sudo)
    if(NOT _tvllm_sudo)
      message(STATUS "Missing packages: not root and no sudo, so they cannot be installed from here")
      return()
    endif()
    set(as_root ${_tvllm_sudo})
  endif()
  string(REPLACE ";" " " shown "${as_root} apt-get install -y ${packages}")
  message(STATUS "Installing missing Debian packages: ${shown}")
  message(STATUS "  (configure with -DTVLLM_INSTALL_DEPS=OFF to install them yourself instead)")
  execute_process(COMMAND ${as_root} apt-get install -y --no-install-recommends ${packages} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    # A fresh image has no package lists yet ("Unable to locate package"): fetch them, then try once more.
    message(STATUS "apt-get install failed; updating the package lists and trying again")
    execute_process(COMMAND ${as_root} apt-get update RESULT_VARIABLE rc)
    if(rc EQUAL 0)
      execute_process(COMMAND ${as_root} apt-get install -y --no-install-recommends ${packages} RESULT_VARIABLE rc)
    endif()
  endif()
  if(rc EQUAL 0)
    set(_tvllm_install_ok TRUE PARENT_SCOPE)
  else()
    message(STATUS "Installing the packages failed (exit ${rc})")
  endif()
endfunction()

# Downloads one dependency's source archive (with a time limit and a checksum) and adds it to the build.
function(_tvllm_fetch name debian_packages)
  set(archive ${CMAKE_BINARY_DIR}/_deps/${name}-source.archive)
  set(have FALSE)
  if(EXISTS ${archive})
    file(SHA256 ${archive} sum)
    if(sum STREQUAL _tvllm_${name}_SHA256)
      set(have TRUE)
    endif()
  endif()
  if(NOT have)
    message(STATUS "${name}: downloading ${_tvllm_${name}_URL} (at most ${TVLLM_FETCH_TIMEOUT} s)")
    # The checksum is compared below, not with EXPECTED_HASH: that would stop on a failed download with
    # a hash mismatch instead of saying why the download failed.
    file(DOWNLOAD ${_tvllm_${name}_URL} ${archive} STATUS st TIMEOUT ${TVLLM_FETCH_TIMEOUT} INACTIVITY_TIMEOUT 30)
    list(GET st 0 code)
    list(GET st 1 why)
    if(code EQUAL 0)
      file(SHA256 ${archive} sum)
      if(NOT sum STREQUAL _tvllm_${name}_SHA256)
        set(code 1)
        set(why "SHA-256 ${sum}, expected ${_tvllm_${name}_SHA256}")
      endif()
    endif()
    if(NOT code EQUAL 0)
      file(REMOVE ${archive})
      message(FATAL_ERROR
        "Cannot download ${name} (${why}): no network here?\n"
        "Install the missing Debian/Ubuntu packages and configure again:\n"
        "  sudo apt-get install ${debian_packages}\n"
        "or point CMake at an installed copy with -DCMAKE_PREFIX_PATH=<prefix>.")
    endif()
  endif()
  # A name of our own: "GTest" would be lowercased to "gtest", which googletest uses for its own project.
  string(TOLOWER "tvllm_dep_${name}" fc)
  FetchContent_Declare(${fc} URL ${archive} URL_HASH SHA256=${_tvllm_${name}_SHA256} DOWNLOAD_EXTRACT_TIMESTAMP TRUE)
  FetchContent_MakeAvailable(${fc})
endfunction()

# Finds every declared dependency; installs or fetches the missing ones (see the top of this file).
macro(tvllm_resolve_dependencies)
  set(_tvllm_missing "")
  set(_tvllm_missing_debs "")
  foreach(_d IN LISTS _tvllm_deps)
    _tvllm_find(${_d})
    if(NOT ${_d}_FOUND)
      list(APPEND _tvllm_missing ${_d})
      list(APPEND _tvllm_missing_debs ${_tvllm_${_d}_DEBIAN})
      if(_tvllm_${_d}_PKGCONFIG AND NOT PKG_CONFIG_EXECUTABLE)
        list(APPEND _tvllm_missing_debs pkg-config)
      endif()
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _tvllm_missing_debs)
  string(REPLACE ";" " " _tvllm_debs_shown "${_tvllm_missing_debs}")
  if(_tvllm_missing)
    message(STATUS "Not found: ${_tvllm_missing} (Debian/Ubuntu packages: ${_tvllm_debs_shown})")
    if(TVLLM_INSTALL_DEPS)
      _tvllm_apt_install("${_tvllm_missing_debs}")
      if(_tvllm_install_ok)
        set(_tvllm_still "")
        foreach(_d IN LISTS _tvllm_missing)
          _tvllm_find(${_d})
          if(NOT ${_d}_FOUND)
            list(APPEND _tvllm_still ${_d})
          endif()
        endforeach()
        set(_tvllm_missing ${_tvllm_still})
      endif()
    else()
      message(STATUS "TVLLM_INSTALL_DEPS is OFF: not installing them")
    endif()
  endif()
  if(_tvllm_missing)
    message(WARNING
      "Missing: ${_tvllm_missing}. Install them with\n"
      "  sudo apt-get install ${_tvllm_debs_shown}\n"
      "(or your system's equivalent). Falling back to downloading the sources (FetchContent).")
  endif()
  foreach(_d IN LISTS _tvllm_missing)
    if(NOT _tvllm_${_d}_URL)
      message(FATAL_ERROR "${_d} not found and it cannot be downloaded: install ${_tvllm_${_d}_DEBIAN}.")
    endif()
    _tvllm_fetch(${_d} "${_tvllm_debs_shown}")
  endforeach()
endmacro()

# The dependencies: one line each.
# The FetchContent fallback of googletest must not install itself or build gmock.
set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
tvllm_dependency(nlohmann_json DEBIAN nlohmann-json3-dev VERSION 3.10
  URL https://github.com/nlohmann/json/releases/download/v3.11.3/json.tar.xz
  SHA256 d6c65aca6b1ed68e7a182f4757257b107ae403032760ed6ef121c9d55e81757d)
tvllm_dependency(CLI11 DEBIAN libcli11-dev VERSION 2.0
  URL https://github.com/CLIUtils/CLI11/archive/refs/tags/v2.4.2.tar.gz
  SHA256 f2d893a65c3b1324c50d4e682c0cdc021dd0477ae2c048544f39eed6654b699a)
if(TVLLM_BUILD_TESTS)
  tvllm_dependency(GTest DEBIAN libgtest-dev
    URL https://github.com/google/googletest/archive/refs/tags/v1.14.0.tar.gz
    SHA256 8ad598c73ad796e0d8280b082cebd82a630d73e73cd3c70057938a6501bba5d7)
endif()
# Lesson 09: the tokenizer's pre-tokenizer regexes (Unicode \p{L}, \p{N}, \s) -> PkgConfig::PCRE2. pkg-config
# also looks in <prefix>/lib/pkgconfig of every CMAKE_PREFIX_PATH entry (the .deps/ staging of tests/gpu_pass.sh).
# No download fallback: PCRE2's own build is large; the configure names the package to install instead.
tvllm_dependency(PCRE2 DEBIAN libpcre2-dev PKGCONFIG libpcre2-8)
# Lesson 09: Unicode normalization (NFC, Qwen2's tokenizer.json normalizer) -> PkgConfig::UTF8PROC. utf8proc is
# the small C library Julia and PostgreSQL use; its tables follow the Unicode standard, so we carry none.
tvllm_dependency(UTF8PROC DEBIAN libutf8proc-dev PKGCONFIG libutf8proc)
# Lesson 13: the HTTP server's HTTP/1.1 parsing and sockets -> PkgConfig::HTTPLIB (Debian builds it as a shared
# library; the GPU machine gets it through .deps/, with LD_LIBRARY_PATH).
tvllm_dependency(HTTPLIB DEBIAN libcpp-httplib-dev PKGCONFIG cpp-httplib)
tvllm_resolve_dependencies()

if(TVLLM_BUILD_TESTS)
  include(GoogleTest)
endif()
