-- A: the in-flight member of an attempt that ended without a report.
land(A[1])
return 1
