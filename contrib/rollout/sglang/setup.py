"""Ships ``rlcore_rollout_sglang.pth`` at the top of site-packages (as setuptools ships its own .pth), so that every
Python process, SGLang's spawned scheduler and detokenizer included, runs ``rlcore_rollout_sglang.startup`` — which
does nothing unless the backend asked for its CPU shims (see rlcore_rollout_sglang/cpu.py)."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "rlcore_rollout_sglang.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH)
        self.copy_file(source, os.path.join(self.build_lib, PTH), preserve_mode=0)
        if getattr(self, "editable_mode", False):
            # an editable wheel holds no build_lib files, only what lies in its unpacked root (install_lib there)
            self.copy_file(source, os.path.join(self.get_finalized_command("install").install_lib, PTH),
                           preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        mapping[os.path.join(self.build_lib, PTH)] = PTH
        return mapping


setup(cmdclass={"build_py": BuildPyWithPth})
