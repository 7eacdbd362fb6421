# CTest ExamplePlugin.SDK (tests/cpp/CMakeLists.txt): the plug-in SDK end to end, as a vendor uses it.
#   1. `cmake --install` the libgla build into BUILD/sdk/install (library, headers, CMake package);
#   2. configure and build examples/plugin as its own project against that prefix only;
#   3. run the C++ tests that load it (ExamplePlugin.*, and the capability tests with it registered).
# Called with -DBUILD=<libgla build dir> -DSOURCE=<source dir> -DTESTS=<gla_tests binary>.
set(prefix ${BUILD}/sdk/install)
set(plugin_build ${BUILD}/sdk/plugin)
file(REMOVE_RECURSE ${BUILD}/sdk)
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "failed (${status}): ${ARGN}\n${out}")
  endif()
  message("${out}")
endfunction()
step(${CMAKE_COMMAND} --install ${BUILD} --prefix ${prefix})
# Only the install prefix: no package registry, no path into the libgla source or build tree.
step(${CMAKE_COMMAND} -S ${SOURCE}/examples/plugin -B ${plugin_build} -DCMAKE_PREFIX_PATH=${prefix}
     -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_BUILD_TYPE=Release)
step(${CMAKE_COMMAND} --build ${plugin_build})
step(${CMAKE_COMMAND} -E env GLA_EXAMPLE_STAGE_PLUGIN=${plugin_build}/libgla_example_stage.so
     ${TESTS} --gtest_brief=1 --gtest_filter=ExamplePlugin.*:Capabilities.*)
