"""asyncrl's tests, laid out as the package is: tests/<package>/ holds the tests of asyncrl/<package>/."""
