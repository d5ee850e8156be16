#include "cli/util.h"

#include <string.h>

#include "store/io.h"

int moectl_read_path(const char *path, char **out, size_t *len)
{
    if (!strcmp(path, "-"))
        return moe_read_stream(stdin, out, len);
    return moe_read_file(path, out, len);
}
