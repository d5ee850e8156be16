/* The project's version, printed by --version. */
#ifndef MOE_VERSION_H
#define MOE_VERSION_H

#define MOE_VERSION "0.6.0"

#endif
