"""Repository rules for building jax_hoccl with Bazel 4.x, fully offline.

* `offline_stub_repository` writes tiny stand-ins for @rules_cc, @rules_java and
  @remote_coverage_tools, which Bazel 4's embedded tools reference but which would
  otherwise be downloaded. They only re-export the native rules.

* `hoccl_configure` (like TensorFlow/JAX's `local_config_python`) finds a Python
  interpreter that has jax/jaxlib and nanobind installed and exposes, as
  @local_config_hoccl:

    //:python_headers   Python's C headers (sysconfig "include")
    //:xla_ffi_headers  jaxlib's XLA FFI headers (jax.ffi.include_dir())
    //:nanobind         nanobind's headers + its runtime sources (nb_combined.cpp),
                        compiled into the extension (like nanobind's NB_STATIC mode)
    //:python_bin.sh    a shell fragment setting PYTHON=<the interpreter>, so tests run
                        with the same interpreter the extension was built against
    //:defs.bzl         PYTHON_BIN, EXT_SUFFIX, PYTHON_VERSION, NANOBIND_VERSION, ...

  The interpreter is $JAX_HOCCL_PYTHON if set, else <workspace>/.venv/bin/python if it
  exists, else `python3` on PATH. The rule re-runs when JAX_HOCCL_PYTHON changes, or on
  `bazel sync --configure` (e.g. after upgrading jax or nanobind in the venv).
"""

_PYTHON_ENV = "JAX_HOCCL_PYTHON"

# ---------------------------------------------------------------------------------------
# Offline stubs
# ---------------------------------------------------------------------------------------

def _offline_stub_repository_impl(ctx):
    for path, content in ctx.attr.files.items():
        ctx.file(path, content, executable = path.endswith(".sh"))
    if "BUILD.bazel" not in ctx.attr.files and "BUILD" not in ctx.attr.files:
        ctx.file("BUILD.bazel", "")
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)

offline_stub_repository = repository_rule(
    implementation = _offline_stub_repository_impl,
    attrs = {"files": attr.string_dict(doc = "path -> content")},
    local = True,
    doc = "A repository made of the given small files (no download).",
)

_RULES_CC_DEFS = '''"""Offline stub of @rules_cc//cc:defs.bzl: the native rules, unchanged."""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_proto_library = native.cc_proto_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
fdo_prefetch_hints = native.fdo_prefetch_hints
fdo_profile = native.fdo_profile
objc_import = native.objc_import
objc_library = native.objc_library
'''

_RULES_CC_BUILD = '''package(default_visibility = ["//visibility:public"])

alias(
    name = "toolchain_type",
    actual = "@bazel_tools//tools/cpp:toolchain_type",
)
'''

_RULES_JAVA_DEFS = '''"""Offline stub of @rules_java//java:defs.bzl: the native rules, unchanged."""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_lite_proto_library = native.java_lite_proto_library
java_package_configuration = native.java_package_configuration
java_plugin = native.java_plugin
java_proto_library = native.java_proto_library
java_runtime = native.java_runtime
java_test = native.java_test
java_toolchain = native.java_toolchain
'''

_COVERAGE_SH = '''#!/bin/sh
echo "coverage is not supported by this offline Bazel setup" >&2
exit 1
'''

_COVERAGE_BUILD = '''package(default_visibility = ["//visibility:public"])

sh_binary(
    name = "coverage_report_generator",
    srcs = ["unsupported.sh"],
)

sh_binary(
    name = "lcov_merger",
    srcs = ["unsupported.sh"],
)
'''

def hoccl_offline_stubs():
    """Declares @rules_cc, @rules_java and @remote_coverage_tools as local stubs."""
    offline_stub_repository(
        name = "rules_cc",
        files = {"cc/BUILD.bazel": _RULES_CC_BUILD, "cc/defs.bzl": _RULES_CC_DEFS},
    )
    offline_stub_repository(
        name = "rules_java",
        files = {"java/BUILD.bazel": "", "java/defs.bzl": _RULES_JAVA_DEFS},
    )
    offline_stub_repository(
        name = "remote_coverage_tools",
        files = {"BUILD.bazel": _COVERAGE_BUILD, "unsupported.sh": _COVERAGE_SH},
    )

# ---------------------------------------------------------------------------------------
# local_config_hoccl
# ---------------------------------------------------------------------------------------

_PROBE = """
import json, os, sys, sysconfig
info = {
    "executable": sys.executable,
    "version": "%d.%d.%d" % sys.version_info[:3],
    "include": sysconfig.get_paths()["include"],
    "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX") or ".so",
}
try:
    import jax
    info["jax_version"] = jax.__version__
    info["ffi_include"] = jax.ffi.include_dir()
except Exception as e:
    info["error"] = "cannot import jax / find jax.ffi.include_dir(): %r" % (e,)
try:
    import nanobind
    info["nanobind_dir"] = os.path.dirname(os.path.abspath(nanobind.__file__))
    info["nanobind_include"] = nanobind.include_dir()
    info["nanobind_version"] = nanobind.__version__
except Exception as e:
    info.setdefault("error", "cannot import nanobind: %r" % (e,))
print(json.dumps(info))
"""

def _fail(msg):
    fail("[local_config_hoccl] %s" % msg)

def _find_python(ctx, workspace):
    python = ctx.os.environ.get(_PYTHON_ENV, "").strip()
    if python:
        if "/" not in python:
            found = ctx.which(python)
            if not found:
                _fail("%s=%s is not on PATH" % (_PYTHON_ENV, python))
            python = str(found)
        return python
    venv = workspace.get_child(".venv").get_child("bin").get_child("python")
    if venv.exists:
        return str(venv)
    found = ctx.which("python3")
    if not found:
        _fail("no Python found: set %s, or create %s/.venv" % (_PYTHON_ENV, workspace))
    return str(found)

def _hoccl_configure_impl(ctx):
    # The workspace root: the folder of the main repository's WORKSPACE file.
    workspace = ctx.path(Label("//:WORKSPACE")).dirname
    python = _find_python(ctx, workspace)

    # Run from the workspace so that pyenv shims honour its .python-version.
    result = ctx.execute([python, "-c", _PROBE], working_directory = str(workspace), quiet = True)
    if result.return_code != 0:
        _fail("probing %s failed:\n%s%s" % (python, result.stdout, result.stderr))
    info = json.decode(result.stdout.strip().splitlines()[-1])
    if "error" in info:
        _fail("%s (Python %s): %s" % (python, info["version"], info["error"]))

    # Pin the interpreter that actually ran (a pyenv shim resolves to the real one; a
    # venv's bin/python stays as is: sys.executable keeps the venv path).
    if info["executable"]:
        python = info["executable"]

    for sub in ["include", "src/nb_combined.cpp", "ext/robin_map/include"]:
        if not ctx.path(info["nanobind_dir"] + "/" + sub).exists:
            _fail("nanobind at %s has no %s (need a nanobind install with its sources)" %
                  (info["nanobind_dir"], sub))

    ctx.symlink(info["include"], "python_include")
    ctx.symlink(info["ffi_include"], "xla_ffi_include")
    ctx.symlink(info["nanobind_dir"] + "/include", "nanobind/include")
    ctx.symlink(info["nanobind_dir"] + "/src", "nanobind/src")
    ctx.symlink(info["nanobind_dir"] + "/ext/robin_map/include", "nanobind/ext/robin_map/include")

    ctx.template("BUILD.bazel", ctx.attr.build_template, {
        "%{PYTHON_BIN}": python,
    }, executable = False)
    ctx.file("python_bin.sh", "# Generated by @local_config_hoccl: the configured interpreter.\nPYTHON='%s'\n" % python, executable = False)
    ctx.file("defs.bzl", "\n".join([
        '"""Generated by @local_config_hoccl (third_party/bazel/repositories.bzl)."""',
        "PYTHON_BIN = %r" % python,
        "PYTHON_VERSION = %r" % info["version"],
        "EXT_SUFFIX = %r" % info["ext_suffix"],
        "JAX_VERSION = %r" % info["jax_version"],
        "NANOBIND_VERSION = %r" % info["nanobind_version"],
        "",
    ]), executable = False)

hoccl_configure = repository_rule(
    implementation = _hoccl_configure_impl,
    attrs = {
        "build_template": attr.label(
            default = Label("//third_party/bazel:local_config_hoccl.BUILD.tpl"),
            allow_single_file = True,
        ),
    },
    environ = [_PYTHON_ENV],
    local = True,
    configure = True,
    doc = "Exposes the local Python, jaxlib's XLA FFI headers and nanobind to Bazel.",
)
