"""Tests of the package part of the same name."""
