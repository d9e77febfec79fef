/* The message walk of `openai_chat.walk_messages`, compiled.
 *
 * Ingesting a large OpenAI-chat log spends most of its time in one Python loop:
 * the walk over each record's messages that lays plain records out in step
 * columns. This is that loop, line for line, in C; `openai_chat.py` keeps the
 * Python version as the reference and the fallback where no compiler was there at
 * install time, and `tests/test_ingest_fast.py` checks that both give the same
 * result on every record shape. Read `walk_messages` first: the comments there
 * say why each check is made; here they only say where C differs in form.
 *
 * walk(messages: list, calls: dict) -> tuple | None, the same tuple as the Python
 * function. `configure(canonical_call, looks_like_error, tool_call, message)`
 * hands over the Python pieces it calls back, once, at import.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

static PyObject *canonical_call;   /* (name, arguments, calls) -> (action, args_json) | None */
static PyObject *looks_like_error; /* text -> bool */
static PyObject *kind_tool_call;   /* actions.TOOL_CALL */
static PyObject *kind_message;     /* actions.MESSAGE */
static PyObject *newline;          /* "\n" */
static PyObject *call_prefix;      /* '{"name":', how a message that parse_action may read as a call starts */
static PyObject *zero_text, *reward_format;
static PyObject *k_assistant_text;

/* "\n".join(filter(None, pending)); most observations are one text, returned as it is (as join does). */
static PyObject *
join_pending(PyObject *pending)
{
    Py_ssize_t n = PyList_GET_SIZE(pending), non_empty = 0;
    PyObject *only = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *text = PyList_GET_ITEM(pending, i);
        if (PyUnicode_GET_LENGTH(text) > 0) {
            non_empty++;
            only = text;
        }
    }
    if (non_empty == 0)
        return PyUnicode_New(0, 0);
    if (non_empty == 1)
        return Py_NewRef(only);
    PyObject *kept = PyList_New(0);
    if (kept == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *text = PyList_GET_ITEM(pending, i);
        if (PyUnicode_GET_LENGTH(text) > 0 && PyList_Append(kept, text) < 0) {
            Py_DECREF(kept);
            return NULL;
        }
    }
    PyObject *joined = PyUnicode_Join(newline, kept);
    Py_DECREF(kept);
    return joined;
}

/* looks_like_error(text), with its first-character shortcut taken here so most texts need no call. */
static int
error_text(PyObject *text)
{
    if (PyUnicode_GET_LENGTH(text) == 0)
        return 0;
    Py_UCS4 first = PyUnicode_READ_CHAR(text, 0);
    if (!Py_UNICODE_ISSPACE(first) && first != 'e' && first != 'E' && first != 'f' && first != 'F' &&
        first != 't' && first != 'T')
        return 0;
    PyObject *flag = PyObject_CallOneArg(looks_like_error, text);
    if (flag == NULL)
        return -1;
    int result = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    return result;
}

/* The columns a walk fills, in the order of the returned tuple. */
enum { OBSERVATIONS, ACTIONS, KINDS, TOOL_NAMES, TOOL_ARGS, IS_ERROR, INFOS, N_COLUMNS };

static int
append_step(PyObject **cols, PyObject **pending, PyObject *action, PyObject *kind, PyObject *name,
            PyObject *args, PyObject *info)
{
    PyObject *observation = join_pending(*pending);
    if (observation == NULL)
        return -1;
    int failed = PyList_Append(cols[OBSERVATIONS], observation) < 0;
    Py_DECREF(observation);
    if (failed)
        return -1;
    if (PyList_SetSlice(*pending, 0, PyList_GET_SIZE(*pending), NULL) < 0) /* emptied in place */
        return -1;
    if (PyList_Append(cols[ACTIONS], action) < 0 || PyList_Append(cols[KINDS], kind) < 0 ||
        PyList_Append(cols[TOOL_NAMES], name) < 0 || PyList_Append(cols[TOOL_ARGS], args) < 0 ||
        PyList_Append(cols[IS_ERROR], Py_False) < 0 || PyList_Append(cols[INFOS], info) < 0)
        return -1;
    return 0;
}

/* Reading a dict's fields in one pass. orjson hands out the same key object for a key it has seen
 * (its key cache), so each field remembers the last key object that spelled it and most keys are
 * settled by comparing pointers; the rest by their (cached) hash, then their text. This replaces a
 * lookup per field, each of which compared our key's text with the dict's. */
enum { F_ROLE, F_CONTENT, F_TOOL_CALLS, F_TOOL_CALL_ID, F_ID, F_FUNCTION, F_NAME, F_ARGUMENTS, F_EXTRA, N_FIELDS = F_EXTRA + 5 };
static const char *field_spelling[N_FIELDS] = {"role", "content", "tool_calls", "tool_call_id", "id", "function",
                                               "name", "arguments", "is_error", "reward", "score", "info",
                                               "candidates"};
static PyObject *field_names[N_FIELDS];
static Py_hash_t field_hashes[N_FIELDS];
static PyObject *field_keys[N_FIELDS]; /* the last key object seen for each field (a strong reference) */

/* The field a key names: >= 0 a field, -1 none of ours, -2 error, -3 not an exact str. */
static int
field_of(PyObject *key)
{
    for (int f = 0; f < N_FIELDS; f++)
        if (key == field_keys[f])
            return f;
    if (!PyUnicode_CheckExact(key))
        return -3;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1)
        return -2;
    for (int f = 0; f < N_FIELDS; f++) {
        if (hash == field_hashes[f] && PyUnicode_Compare(key, field_names[f]) == 0) {
            Py_XSETREF(field_keys[f], Py_NewRef(key));
            return f;
        }
    }
    return -1;
}

/* values[f] = dict.get(field f) (borrowed, NULL where absent). 1 done; 0 the dict cannot be plain (a
 * key that is not an exact str, or with `extras_rule_out`, one of the extras); -1 error. */
static int
read_fields(PyObject *dict, PyObject **values, int extras_rule_out)
{
    for (int f = 0; f < N_FIELDS; f++)
        values[f] = NULL;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(dict, &pos, &key, &value)) {
        int f = field_of(key);
        if (f == -2)
            return -1;
        if (f == -3 || (f >= F_EXTRA && extras_rule_out))
            return 0;
        if (f >= 0)
            values[f] = value;
    }
    return 1;
}

/* One assistant tool call: 1 appended, 0 not plain, -1 error. */
static int
tool_call(PyObject *call, Py_ssize_t k, PyObject *text, PyObject *calls, PyObject *open_calls,
          PyObject **cols, PyObject **pending)
{
    if (!PyDict_CheckExact(call))
        return 0;
    PyObject *values[N_FIELDS];
    int read = read_fields(call, values, 0);
    if (read != 1)
        return read;
    PyObject *function = values[F_FUNCTION], *call_id = values[F_ID];
    if (function == NULL || !PyDict_CheckExact(function) || call_id == NULL || !PyUnicode_CheckExact(call_id))
        return 0;
    int open = PyDict_Contains(open_calls, call_id);
    if (open != 0)
        return open < 0 ? -1 : 0;
    if ((read = read_fields(function, values, 0)) != 1)
        return read;
    PyObject *name = values[F_NAME], *arguments = values[F_ARGUMENTS];
    name = name ? name : Py_None;
    arguments = arguments ? arguments : Py_None;
    PyObject *canonical = NULL; /* new reference */
    if (PyUnicode_CheckExact(name) && PyUnicode_CheckExact(arguments)) { /* calls[name][arguments] */
        PyObject *by_arguments = PyDict_GetItemWithError(calls, name);
        if (by_arguments == NULL && PyErr_Occurred())
            return -1;
        if (by_arguments != NULL && PyDict_CheckExact(by_arguments)) {
            canonical = PyDict_GetItemWithError(by_arguments, arguments);
            if (canonical == NULL && PyErr_Occurred())
                return -1;
            Py_XINCREF(canonical);
        }
    }
    if (canonical == NULL) {
        canonical = PyObject_CallFunctionObjArgs(canonical_call, name, arguments, calls, NULL);
        if (canonical == NULL)
            return -1;
        if (canonical == Py_None) {
            Py_DECREF(canonical);
            return 0;
        }
    }
    if (!PyTuple_CheckExact(canonical) || PyTuple_GET_SIZE(canonical) != 2) {
        Py_DECREF(canonical);
        PyErr_SetString(PyExc_TypeError, "canonical_call must return an (action, arguments) pair or None");
        return -1;
    }
    PyObject *index = PyLong_FromSsize_t(PyList_GET_SIZE(cols[ACTIONS]));
    int failed = index == NULL || PyDict_SetItem(open_calls, call_id, index) < 0;
    Py_XDECREF(index);
    PyObject *info = Py_None;
    Py_INCREF(info);
    if (!failed && k == 0 && PyUnicode_GET_LENGTH(text) > 0) {
        Py_SETREF(info, PyDict_New());
        failed = info == NULL || PyDict_SetItem(info, k_assistant_text, text) < 0;
    }
    failed = failed || append_step(cols, pending, PyTuple_GET_ITEM(canonical, 0), kind_tool_call, name,
                                   PyTuple_GET_ITEM(canonical, 1), info) < 0;
    Py_XDECREF(info);
    Py_DECREF(canonical);
    return failed ? -1 : 1;
}

/* One message: 1 taken, 0 not plain, -1 error. */
static int
message_step(PyObject *message, PyObject *calls, PyObject *open_calls, PyObject **cols, PyObject **pending,
             PyObject *system, PyObject **first_user)
{
    if (!PyDict_CheckExact(message))
        return 0;
    PyObject *values[N_FIELDS];
    int read = read_fields(message, values, 1);
    if (read != 1)
        return read;
    PyObject *role = values[F_ROLE], *text = values[F_CONTENT];
    if (text == NULL || text == Py_None)
        text = PyUnicode_New(0, 0); /* the empty string singleton: a new reference */
    else if (PyUnicode_CheckExact(text))
        Py_INCREF(text);
    else
        return 0;
    int result = 0;
    if (role == NULL || !PyUnicode_CheckExact(role)) {
        result = 0;
    } else if (PyUnicode_CompareWithASCIIString(role, "assistant") == 0) {
        PyObject *tool_calls = values[F_TOOL_CALLS];
        int any = tool_calls == NULL ? 0 : PyObject_IsTrue(tool_calls);
        if (any < 0) {
            result = -1;
        } else if (!any) {
            Py_ssize_t looks_like_call = PyUnicode_Tailmatch(text, call_prefix, 0, PY_SSIZE_T_MAX, -1);
            if (looks_like_call != 0)
                result = looks_like_call < 0 ? -1 : 0;
            else if (PyUnicode_GET_LENGTH(text) == 0)
                result = 1;
            else
                result = append_step(cols, pending, text, kind_message, Py_None, Py_None, Py_None) < 0 ? -1 : 1;
        } else if (!PyList_CheckExact(tool_calls)) {
            result = 0;
        } else {
            result = 1;
            for (Py_ssize_t k = 0; k < PyList_GET_SIZE(tool_calls) && result == 1; k++)
                result = tool_call(PyList_GET_ITEM(tool_calls, k), k, text, calls, open_calls, cols, pending);
        }
    } else if (PyUnicode_CompareWithASCIIString(role, "user") == 0) {
        if (*first_user == Py_None) {
            Py_INCREF(text);
            Py_SETREF(*first_user, text);
        }
        result = PyList_Append(*pending, text) < 0 ? -1 : 1;
    } else if (PyUnicode_CompareWithASCIIString(role, "tool") == 0 ||
               PyUnicode_CompareWithASCIIString(role, "function") == 0) {
        PyObject *call_id = values[F_TOOL_CALL_ID];
        PyObject *index = NULL;
        if (call_id == NULL || !PyUnicode_CheckExact(call_id))
            result = 0;
        else if ((index = PyDict_GetItemWithError(open_calls, call_id)) == NULL)
            result = PyErr_Occurred() ? -1 : 0;
        else if (Py_INCREF(index), PyDict_DelItem(open_calls, call_id) < 0) /* pop: its only result */
            result = -1;
        else {
            int error = error_text(text);
            Py_ssize_t at = PyLong_AsSsize_t(index);
            if (error < 0 || (at == -1 && PyErr_Occurred()))
                result = -1;
            else if (PyList_SetItem(cols[IS_ERROR], at, Py_NewRef(error ? Py_True : Py_False)) < 0)
                result = -1;
            else
                result = PyList_Append(*pending, text) < 0 ? -1 : 1;
        }
        Py_XDECREF(index);
    } else if (PyUnicode_CompareWithASCIIString(role, "system") == 0 ||
               PyUnicode_CompareWithASCIIString(role, "developer") == 0) {
        result = PyList_Append(system, text) < 0 ? -1 : 1;
    }
    Py_DECREF(text);
    return result;
}

static PyObject *
walk(PyObject *module, PyObject *args)
{
    PyObject *messages, *calls;
    if (!PyArg_ParseTuple(args, "O!O!:walk", &PyList_Type, &messages, &PyDict_Type, &calls))
        return NULL;
    if (canonical_call == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "call configure() before walk()");
        return NULL;
    }
    PyObject *cols[N_COLUMNS] = {NULL};
    PyObject *pending = PyList_New(0), *system = PyList_New(0), *open_calls = PyDict_New();
    PyObject *first_user = Py_NewRef(Py_None), *out = NULL;
    int status = pending && system && open_calls ? 1 : -1;
    for (int i = 0; i < N_COLUMNS && status == 1; i++)
        status = (cols[i] = PyList_New(0)) ? 1 : -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(messages) && status == 1; i++) {
        PyObject *message = PyList_GET_ITEM(messages, i);
        Py_INCREF(message); /* the callbacks could in principle change the list */
        status = message_step(message, calls, open_calls, cols, &pending, system, &first_user);
        Py_DECREF(message);
    }
    if (status == 1) {
        out = PyTuple_Pack(N_COLUMNS + 3, cols[0], cols[1], cols[2], cols[3], cols[4], cols[5], cols[6], pending,
                           system, first_user);
    } else if (status == 0) {
        out = Py_NewRef(Py_None);
    }
    for (int i = 0; i < N_COLUMNS; i++)
        Py_XDECREF(cols[i]);
    Py_XDECREF(pending);
    Py_XDECREF(system);
    Py_XDECREF(open_calls);
    Py_DECREF(first_user);
    return out;
}

static PyObject *
configure(PyObject *module, PyObject *args)
{
    PyObject *canonical, *error, *tool, *message;
    if (!PyArg_ParseTuple(args, "OOUU:configure", &canonical, &error, &tool, &message))
        return NULL;
    Py_XSETREF(canonical_call, Py_NewRef(canonical));
    Py_XSETREF(looks_like_error, Py_NewRef(error));
    Py_XSETREF(kind_tool_call, Py_NewRef(tool));
    Py_XSETREF(kind_message, Py_NewRef(message));
    Py_RETURN_NONE;
}

/* reward as the digest writes it, "{:.6g}": a new reference. 0.0, most steps' reward under `--reward
 * outcome`, is "0" without a call to format. */
static PyObject *
reward_text(PyObject *reward)
{
    if (PyFloat_CheckExact(reward) && PyFloat_AS_DOUBLE(reward) == 0.0 && !signbit(PyFloat_AS_DOUBLE(reward)))
        return Py_NewRef(zero_text);
    return PyObject_Format(reward, reward_format);
}

/* The bytes `dataset.episode_digest` hashes: episode_id.encode() + body.encode(errors="surrogatepass"), body
 * = "".join(map("\x00{}\x01{}\x02{:.6g}".format, actions, observations, rewards)). Built by copying each
 * text's UTF-8 (which a str keeps, or computes once) straight into the result. A text with a lone
 * surrogate has no UTF-8 of its own: then None, and the caller takes `dataset._digest_bytes_python`. */
static PyObject *
digest_bytes(PyObject *module, PyObject *args)
{
    PyObject *episode_id, *actions, *observations, *rewards;
    if (!PyArg_ParseTuple(args, "UO!O!O!:digest_bytes", &episode_id, &PyList_Type, &actions, &PyList_Type,
                          &observations, &PyList_Type, &rewards))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(actions);
    if (PyList_GET_SIZE(observations) != n || PyList_GET_SIZE(rewards) != n) {
        PyErr_SetString(PyExc_ValueError, "actions, observations and rewards must have one entry per step");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyUnicode_Check(PyList_GET_ITEM(actions, i)) || !PyUnicode_Check(PyList_GET_ITEM(observations, i))) {
            PyErr_SetString(PyExc_TypeError, "actions and observations must be strings");
            return NULL;
        }
    Py_ssize_t id_size;
    const char *id_utf8 = PyUnicode_AsUTF8AndSize(episode_id, &id_size); /* strict, as episode_id.encode() */
    if (id_utf8 == NULL)
        return NULL;
    /* Per step: the UTF-8 of action, observation and reward text, and the reward text object. */
    const char **texts = PyMem_Malloc(sizeof(char *) * 3 * (n ? n : 1));
    Py_ssize_t *sizes = PyMem_Malloc(sizeof(Py_ssize_t) * 3 * (n ? n : 1));
    PyObject *reward_texts = PyList_New(n);
    PyObject *out = NULL;
    int general = 0;
    Py_ssize_t total = id_size + 3 * n;
    if (texts == NULL || sizes == NULL || reward_texts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n && !general; i++) {
        PyObject *reward = reward_text(PyList_GET_ITEM(rewards, i));
        if (reward == NULL)
            goto done;
        PyList_SET_ITEM(reward_texts, i, reward);
        PyObject *step[3] = {PyList_GET_ITEM(actions, i), PyList_GET_ITEM(observations, i), reward};
        for (int k = 0; k < 3; k++) {
            texts[3 * i + k] = PyUnicode_AsUTF8AndSize(step[k], &sizes[3 * i + k]);
            if (texts[3 * i + k] == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
                    goto done;
                PyErr_Clear();
                general = 1;
                break;
            }
            total += sizes[3 * i + k];
        }
    }
    if (general) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    if ((out = PyBytes_FromStringAndSize(NULL, total)) == NULL)
        goto done;
    char *at = PyBytes_AS_STRING(out);
    memcpy(at, id_utf8, id_size);
    at += id_size;
    static const char separators[3] = {'\x00', '\x01', '\x02'};
    for (Py_ssize_t i = 0; i < 3 * n; i++) {
        *at++ = separators[i % 3];
        memcpy(at, texts[i], sizes[i]);
        at += sizes[i];
    }
done:
    PyMem_Free(texts);
    PyMem_Free(sizes);
    Py_XDECREF(reward_texts);
    return out;
}

/* The step columns of one episode appended to a row group's lists: `EpisodeRows._add_columns` in C.
 * extend_columns(lists, episode_id, observations, actions, kinds, tool_names, tool_args, is_error, infos,
 *                rewards, truncated, index, to_json)
 * lists: the 14 lists episode_id, step, observation, action, action_kind, tool_name, tool_args, reward,
 * terminated, truncated, is_error, candidates, info, episode_index; the per-step arguments are lists of
 * one length n >= 1; infos that are None or empty are written None, the others as to_json(info). */
enum { L_EPISODE_ID, L_STEP, L_OBSERVATION, L_ACTION, L_KIND, L_TOOL_NAME, L_TOOL_ARGS, L_REWARD, L_TERMINATED,
       L_TRUNCATED, L_IS_ERROR, L_CANDIDATES, L_INFO, L_EPISODE_INDEX, N_LISTS };

static int
extend_list(PyObject *list, PyObject *items)
{
    return PyList_SetSlice(list, PyList_GET_SIZE(list), PyList_GET_SIZE(list), items);
}

static PyObject *
extend_columns(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "extend_columns takes 13 arguments");
        return NULL;
    }
    PyObject *lists = args[0], *episode_id = args[1], *infos = args[8], *rewards = args[9], *to_json = args[12];
    int truncated = PyObject_IsTrue(args[10]);
    if (truncated < 0)
        return NULL;
    if (!PyTuple_CheckExact(lists) || PyTuple_GET_SIZE(lists) != N_LISTS) {
        PyErr_SetString(PyExc_TypeError, "lists must be a tuple of 14 lists");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < N_LISTS; i++)
        if (!PyList_CheckExact(PyTuple_GET_ITEM(lists, i))) {
            PyErr_SetString(PyExc_TypeError, "lists must be a tuple of 14 lists");
            return NULL;
        }
    Py_ssize_t n = PyList_Check(args[3]) ? PyList_GET_SIZE(args[3]) : -1;
    for (int a = 2; a <= 9; a++)
        if (!PyList_Check(args[a]) || PyList_GET_SIZE(args[a]) != n || n < 1) {
            PyErr_SetString(PyExc_ValueError, "the per-step columns must be lists of one length, at least 1");
            return NULL;
        }
#define L(i) PyTuple_GET_ITEM(lists, i)
    if (extend_list(L(L_OBSERVATION), args[2]) < 0 || extend_list(L(L_ACTION), args[3]) < 0 ||
        extend_list(L(L_KIND), args[4]) < 0 || extend_list(L(L_TOOL_NAME), args[5]) < 0 ||
        extend_list(L(L_TOOL_ARGS), args[6]) < 0 || extend_list(L(L_IS_ERROR), args[7]) < 0 ||
        extend_list(L(L_REWARD), rewards) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *step = PyLong_FromSsize_t(i);
        if (step == NULL)
            return NULL;
        int last = i == n - 1, failed = PyList_Append(L(L_STEP), step) < 0;
        Py_DECREF(step);
        PyObject *info = PyList_GET_ITEM(infos, i), *text;
        int empty = info == Py_None ? 1 : !PyObject_IsTrue(info);
        if (empty < 0)
            return NULL;
        text = empty ? Py_NewRef(Py_None) : PyObject_CallOneArg(to_json, info);
        if (text == NULL)
            return NULL;
        failed = failed || PyList_Append(L(L_INFO), text) < 0;
        Py_DECREF(text);
        if (failed || PyList_Append(L(L_EPISODE_ID), episode_id) < 0 ||
            PyList_Append(L(L_TERMINATED), last && !truncated ? Py_True : Py_False) < 0 ||
            PyList_Append(L(L_TRUNCATED), last && truncated ? Py_True : Py_False) < 0 ||
            PyList_Append(L(L_CANDIDATES), Py_None) < 0 || PyList_Append(L(L_EPISODE_INDEX), args[11]) < 0)
            return NULL;
    }
#undef L
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"digest_bytes", digest_bytes, METH_VARARGS, "the bytes episode_digest hashes, or None (lone surrogates)"},
    {"extend_columns", (PyCFunction)(void (*)(void))extend_columns, METH_FASTCALL,
     "one columnar episode's step columns appended to a row group's lists"},
    {"walk", walk, METH_VARARGS, "walk(messages, calls) -> columns tuple, or None when the record is not plain"},
    {"configure", configure, METH_VARARGS, "configure(canonical_call, looks_like_error, tool_call, message)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_speedups", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    for (int f = 0; f < N_FIELDS; f++)
        if ((field_names[f] = PyUnicode_InternFromString(field_spelling[f])) == NULL ||
            (field_hashes[f] = PyObject_Hash(field_names[f])) == -1)
            return NULL;
    if (!(newline = PyUnicode_InternFromString("\n")) ||
        !(call_prefix = PyUnicode_InternFromString("{\"name\":")) ||
        !(zero_text = PyUnicode_FromString("0")) || !(reward_format = PyUnicode_FromString(".6g")) ||
        !(k_assistant_text = PyUnicode_InternFromString("assistant_text")))
        return NULL;
    return PyModule_Create(&module_def);
}
