"""Ships `shardpar_smdistributed.pth` at the top of site-packages, where `site` runs its import line at
start-up; setuptools has no declarative way to place a file beside the packages, hence this build_py."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "shardpar_smdistributed.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        os.makedirs(self.build_lib, exist_ok=True)
        here = os.path.dirname(os.path.abspath(__file__))
        shutil.copyfile(os.path.join(here, PTH), os.path.join(self.build_lib, PTH))


setup(cmdclass={"build_py": BuildWithPth})
