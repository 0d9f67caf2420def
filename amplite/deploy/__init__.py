"""Compiled deployment of a converted program: AOTInductor packages, built and verified as written."""

from amplite.deploy.aoti import AotiPackage, AotiVerification, package_aoti, verify_aoti

__all__ = ["AotiPackage", "AotiVerification", "package_aoti", "verify_aoti"]
