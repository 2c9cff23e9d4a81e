/* What every kernel source shares: the mark of an exported entry point (the library is built
   with -fvisibility=hidden: only these are symbols ctypes can find). */
#ifndef V1_H
#define V1_H

#define V1_API __attribute__((visibility("default")))

#endif
