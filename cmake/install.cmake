# `cmake --install BUILD [--prefix DIR]`: the public headers, the library, a CMake package
# (find_package(sparsa) gives the imported target sparsa::sparsa) and a pkg-config file.
# Included from the top-level CMakeLists.txt after the library target is defined.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS sparsa EXPORT sparsaTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/sparsa DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT sparsaTargets NAMESPACE sparsa:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/sparsa)

set(SPARSA_CONFIG_CUDA ${SPARSA_WITH_CUDA_LIBRARY})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/sparsaConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/sparsaConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/sparsa)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/sparsaConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/sparsaConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/sparsaConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/sparsa)

# pkg-config: the static library and what it needs (threads; the CUDA runtime when compiled in).
# The public headers need no definition, so Cflags is the include directory alone; the prefix is
# the .pc file's own place, so an install moved with --prefix still resolves.
set(SPARSA_PC_LIBS "-L\${libdir} -lsparsa -lpthread")
if(SPARSA_WITH_CUDA_LIBRARY)
  get_target_property(SPARSA_CUDART_STATIC CUDA::cudart_static IMPORTED_LOCATION)
  get_filename_component(SPARSA_CUDART_DIR "${SPARSA_CUDART_STATIC}" DIRECTORY)
  set(SPARSA_PC_LIBS "${SPARSA_PC_LIBS} -L${SPARSA_CUDART_DIR} -lcudart_static -ldl -lrt")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/sparsa.pc.in ${CMAKE_CURRENT_BINARY_DIR}/sparsa.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/sparsa.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
